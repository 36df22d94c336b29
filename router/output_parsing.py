"""Reasoning and tool calls out of a chat completion's text, by vLLM 0.32's own parsers
(--reasoning-parser, --tool-call-parser) combined as vLLM's server combines them: its
`ParserManager` composes the two into one `Parser` (reasoning first; tool calls parsed from
the content after the reasoning ends), used per request, whole or delta by delta. That
composition (engine-based parsers, the prompt's reasoning state, end-of-stream flushes) is
vLLM's code, not a copy of it. Forced calls ("required", a named function) are parsed from the
JSON their schema imposes, without vLLM (router/tool_calls.py).

  OutputParsing(tokenizer, tool_call_parser, reasoning_parser)     once per router; imports
      vLLM (~15 s) only when a parser is named; ValueError names a flag vLLM cannot serve
  .start(use, prompt_ids, ...) -> ChoiceParser                     once per request
      .skip_special_tokens       how to detokenize the output (some parsers need the markers)
      .whole(text)               non-streaming: the message's content, reasoning, tool_calls
      .feed(text, ids)...        streaming: a delta (or None) per piece of text,
      .finish()                  then one more at the end (what parsers held back)
      .finish_reason(reason)     "tool_calls" where vLLM says so

Deltas and messages are vLLM's: reasoning goes in the field `reasoning` (vLLM 0.32's name, in
messages and deltas alike; not DeepSeek's `reasoning_content`), tool-call deltas carry `index`,
and `id`, `type`, `function.name` the first time.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.tool_calls import (
    ConstrainedCalls,
    ToolUse,
    calls_from_constrained_output,
    new_call_id,
)


class OutputParsing:
    def __init__(
        self, tokenizer, tool_call_parser: str | None = None, reasoning_parser: str | None = None
    ) -> None:
        """`tokenizer`: the model's Hugging Face tokenizer; parser names as vLLM registers
        them (hermes, llama3_json, pythonic, ...; qwen3, deepseek_r1, ...)."""
        tool_call_parser, reasoning_parser = tool_call_parser or None, reasoning_parser or None
        self.auto_tools = tool_call_parser is not None
        """Whether tool_choice "auto" can be served (router.tool_calls.check_tools)."""
        self._vllm = None
        if tool_call_parser or reasoning_parser:
            self._vllm = _VllmParsers(tokenizer, tool_call_parser, reasoning_parser)

    def start(
        self,
        use: ToolUse,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        chat_template_kwargs: dict | None = None,
        include_reasoning: bool = True,
    ) -> ChoiceParser:
        """The parser of one request's output. `skip_special_tokens`: the client's;
        `chat_template_kwargs`: those the prompt was rendered with (qwen3 reads
        enable_thinking); `include_reasoning` False (vLLM's): the reasoning is parsed out and
        left out of the answer."""
        if self._vllm is None:
            parser = ChoiceParser(use, None, None, prompt_ids, skip_special_tokens)
        else:
            parser = self._vllm.start(use, prompt_ids, skip_special_tokens, chat_template_kwargs)
        parser.include_reasoning = include_reasoning
        return parser


class ChoiceParser:
    """One output's parsing, whole or streamed (not both): vLLM's parsers keep state."""

    def __init__(self, use: ToolUse, parser, request, prompt_ids, skip_special_tokens) -> None:
        self.skip_special_tokens = skip_special_tokens
        """False when a parser reads markers the tokenizer calls special (vLLM's
        `adjust_request` says so): the router detokenizes with this."""
        self._use = use
        self._parser = parser
        """vLLM's composed Parser; None: the text is content (or forced calls)."""
        self._request = request
        """vLLM's ChatCompletionRequest, as its parsers read it."""
        self._prompt_ids = list(prompt_ids)
        self._forced = ConstrainedCalls(use.tool_choice) if use.constrained else None
        self._called = False
        self.include_reasoning = True
        """False: the reasoning a reasoning parser finds is left out (vLLM's include_reasoning)."""

    def whole(self, text: str) -> dict:
        """The message's fields besides `role`: content, reasoning (None without a reasoning
        parser or reasoning), and tool_calls when there are any, as vLLM answers them."""
        reasoning, content, calls = None, text, []
        if self._parser is not None:
            self._parser.set_prompt_token_ids(self._prompt_ids)
            reasoning, content, found = self._parser.parse(
                text, self._request, enable_auto_tools=True
            )
            calls = [_tool_call(call) for call in found or ()]
        if self._forced is not None:
            try:
                calls = calls_from_constrained_output(content or "", self._use.tool_choice)
            except ValueError:  # vLLM drops an array it cannot parse (cut off by max_tokens)
                calls = []
            content = ""  # vLLM's content beside forced calls
        if not self._use.parallel_tool_calls:
            calls = calls[:1]
        self._called = bool(calls)
        message = {"content": content, "reasoning": reasoning if self.include_reasoning else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def feed(self, delta_text: str, delta_ids: Sequence[int]) -> dict | None:
        """The delta for the next piece of text and the ids of the tokens it came from:
        {"content"}, {"reasoning"}, {"tool_calls": [...]} or a mix; None when the parsers
        hold the text back (a possible tag's start, a marker)."""
        return self._step(delta_text, delta_ids, finished=False)

    def finish(self) -> dict | None:
        """After the last piece: the delta of what the parsers held (e.g. the arguments'
        last characters, reasoning cut off before its end), or None."""
        return self._step("", (), finished=True)

    def finish_reason(self, reason: str) -> str:
        """vLLM's: "tool_calls" for an output that called tools (a named function's call
        excepted: that stays "stop") and ended by itself."""
        named = isinstance(self._use.tool_choice, dict)
        return "tool_calls" if self._called and not named and reason == "stop" else reason

    def _step(self, text: str, ids: Sequence[int], finished: bool) -> dict | None:
        if self._parser is None:
            delta = {"content": text} if text else None
        else:
            message = self._parser.parse_delta(
                text, list(ids), self._request, self._prompt_ids, finished=finished
            )
            # NOTE: exclude_unset, as vLLM serializes its chunks: a field a parser set to
            # None explicitly is sent as null.
            delta = message.model_dump(exclude_unset=True) if message is not None else None
        if delta is None:
            return None
        if not self.include_reasoning:
            delta.pop("reasoning", None)
        if self._forced is not None and "content" in delta:
            calls = self._forced.feed(delta.pop("content") or "")
            if calls:
                delta["tool_calls"] = calls
        if "tool_calls" in delta and not self._use.parallel_tool_calls:
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c["index"] == 0]
        if not delta.get("tool_calls"):
            delta.pop("tool_calls", None)
        else:
            self._called = True
        return delta or None


class _VllmParsers:
    """vLLM's parser classes for this tokenizer, checked at start-up as `vllm serve` checks
    them, and the per-request objects its parsers read."""

    def __init__(self, tokenizer, tool_call_parser: str | None, reasoning_parser: str | None):
        # Imported here: ~15 s, and only a router with a parser needs it.
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.parser_manager import ParserManager
        from vllm.reasoning import ReasoningParserManager
        from vllm.tokenizers.hf import get_cached_tokenizer
        from vllm.tool_parsers import ToolParserManager

        _check_registered("--tool-call-parser", tool_call_parser, ToolParserManager)
        _check_registered("--reasoning-parser", reasoning_parser, ReasoningParserManager)
        # NOTE: vLLM's server holds its tokenizer so wrapped: without the cached vocabulary,
        # building qwen3's parser (per request) took 50 ms instead of 0.2 ms.
        self.tokenizer = get_cached_tokenizer(tokenizer)
        self.request_cls = ChatCompletionRequest

        def composed(tools: str | None, reasoning: str | None):
            try:  # ParserManager constructs one to see that the tokenizer has its markers
                return ParserManager.get_parser(
                    tool_parser_name=tools, reasoning_parser_name=reasoning,
                    enable_auto_tools=True, tokenizer=self.tokenizer,
                    model_name=getattr(tokenizer, "name_or_path", None),
                )  # fmt: skip
            except TypeError as e:
                raise ValueError(str(e)) from None

        self.full = composed(tool_call_parser, reasoning_parser)
        self.reasoning_only = composed(None, reasoning_parser) if reasoning_parser else None
        """For forced calls: reasoning, then JSON that tool_calls.py parses."""

    def start(self, use: ToolUse, prompt_ids, skip_special_tokens, chat_template_kwargs):
        body = {"messages": [], "tool_choice": use.tool_choice,
                "parallel_tool_calls": use.parallel_tool_calls,
                "skip_special_tokens": skip_special_tokens,
                "chat_template_kwargs": chat_template_kwargs}  # fmt: skip
        if use.tools is not None:
            body["tools"] = use.tools
        request = self.request_cls.model_validate(body)
        kwargs = {"chat_template_kwargs": chat_template_kwargs}
        if self.reasoning_only is not None or use.tool_choice != "none":
            # What vLLM's renderer does before generating; of the request it changes, the
            # router reads only skip_special_tokens (it builds its own grammar; the
            # structural tag vLLM would add is skipped).
            adjusting = self.full(self.tokenizer, request.tools, **kwargs)
            for part in (adjusting.reasoning_parser, adjusting.tool_parser):
                if part is not None:
                    request = part.adjust_request(request)
        cls = self.reasoning_only if use.constrained else self.full
        parser = cls(self.tokenizer, request.tools, **kwargs) if cls is not None else None
        return ChoiceParser(use, parser, request, prompt_ids, request.skip_special_tokens)


def _check_registered(flag: str, name: str | None, manager) -> None:
    registered = manager.list_registered()
    if name is not None and name not in registered:
        raise ValueError(f"{flag} {name!r}: not one of vLLM's: {', '.join(sorted(registered))}")


def _tool_call(call) -> dict:
    """OpenAI's tool call from vLLM's FunctionCall (a parser's id kept, as vLLM keeps it)."""
    return {"id": call.id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
