"""Every check on a /v1/completions or /v1/chat/completions body, in two pure functions:

  raw body --parse--> ApiRequest --(tokenize the prompt)--> generation_request --> GenerationRequest

`parse` checks all that does not depend on the prompt's token count; `generation_request` checks
the rest (the context length) once the prompt is tokenized. Both raise RequestError with the
HTTP status, a message and the offending parameter, so no backend ever sees a value it would
refuse. A field sent as `null` is absent. Parameters the stack cannot honour are refused by
name, never dropped; the few OpenAI defines as hints without effect here are accepted
(`IGNORED`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from engine import json_body
from engine.sampling_ranges import MAX_LOGPROBS, checked_sampling_value
from proto.tandem.v1 import decode_pb2
from router import structured
from router.body_values import (
    allowed_token_ids,
    checked_max_tokens,
    flag,
    integer,
    is_token_id,
    logit_bias,
    request_id,
    seed,
    stops,
    whole,
)
from router.errors import RequestError
from router.generation import GenerationRequest
from router.messages import TEMPLATE_FIELDS, chat_messages, template_arguments
from router.sampling_defaults import OPENAI
from router.tool_calls import ToolUse, check_tools, template_tools, tool_choice_schema

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_CHOICES = 128
"""`n` at most (OpenAI's limit)."""
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
            "presence_penalty", "frequency_penalty")  # fmt: skip
"""Numbers passed to tandem.v1.SamplingParams under the same name."""
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
"""OpenAI's fields that identify or label a request, or hint at an absent feature: accepted,
without effect (as vLLM does)."""
_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
_COMMON = {"model", "max_tokens", "stop", "stop_token_ids", "stream", "stream_options", "n",
           "ignore_eos", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias",
           "skip_special_tokens", "return_token_ids", "return_tokens_as_token_ids",
           "add_special_tokens", "request_id", "echo", "allowed_token_ids",
           "include_stop_str_in_output", *SAMPLING, *IGNORED, *structured.FIELDS}  # fmt: skip
_NOT_YET = {
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
}
"""Known parameters tandem does not serve yet, and the values that ask for nothing."""


class Endpoint(enum.Enum):
    """Which API a request came in on; the value is its response's `object`."""

    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self is Endpoint.CHAT else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self is Endpoint.CHAT else "cmpl"

    @property
    def parameters(self) -> frozenset[str]:
        if self is Endpoint.CHAT:
            extra = {
                "messages",
                "max_completion_tokens",
                "top_logprobs",
                "include_reasoning",
                *TEMPLATE_FIELDS,
                *_TOOLS,
            }
        else:
            extra = {"prompt"}
        return frozenset(_COMMON | extra | set(_NOT_YET))

    @property
    def not_yet(self) -> dict:
        """Its known parameters tandem does not serve yet, and the values that ask for
        nothing (as vLLM's server, which refuses them too)."""
        return _NOT_YET


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against."""

    name: str
    max_model_len: int
    vocab_size: int
    """Token ids are below this (the model's embedding rows)."""
    auto_tools: bool = False
    """tool_choice "auto" is served (a --tool-call-parser is configured)."""
    spec_metrics: bool = False
    """One-choice responses carry their speculative decoding (vLLM's
    --per-request-spec-decode-metrics summary)."""
    sampling_defaults: Mapping[str, float | int] = field(default_factory=lambda: dict(OPENAI))
    """What a request leaves unset samples with (router/sampling_defaults.py)."""


Prompt = tuple[str | None, list[int] | None]
"""A completion's prompt: (text, None) or (None, token ids)."""


@dataclass(frozen=True)
class ApiRequest:
    """A body that passed `parse`. Exactly one of `text`, `token_ids` and `messages` is set."""

    endpoint: Endpoint
    text: str | None
    """Completions: a prompt to tokenize."""
    token_ids: list[int] | None
    """Completions: a prompt given as token ids."""
    messages: list[dict] | None
    """Chat: the conversation, as router/messages.py readies it for the template."""
    max_tokens: int | None
    """At least 1; None: whatever the context leaves after the prompt."""
    sampling: decode_pb2.SamplingParams
    """The fields the client set; `logprobs` set when it asked for log-probabilities."""
    template: dict | None = None
    """Chat: the template's arguments in vLLM's names (add_generation_prompt,
    continue_final_message, tools, chat_template_kwargs)."""
    structured: decode_pb2.StructuredOutput | None = None
    """The grammar the output must follow (router/structured.py, or a forced tool call's)."""
    tools: ToolUse | None = None
    """Chat: the request's tools and tool_choice, checked (router/tool_calls.py)."""
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stops: tuple[str, ...] = ()
    """Stop strings, none empty."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False
    """Logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
    return_token_ids: bool = False
    """The response carries the prompt's token ids and each choice's (vLLM's)."""
    include_reasoning: bool = True
    """Chat: the reasoning a --reasoning-parser finds is answered (vLLM's)."""
    request_id: str | None = None
    """vLLM's: the request's id (the response's is "cmpl-<id>"), unless X-Request-Id names one."""
    add_special_tokens: bool = True
    """The tokenizer adds its special tokens (a BOS) to a text prompt, or, for chat, to the
    rendered template besides those the template writes (vLLM's; chat's default is False)."""
    stream: bool = False
    include_usage: bool = False
    """Streaming: end with a chunk that carries the usage."""
    n: int = 1
    """Choices to generate (of each prompt)."""
    echo: bool = False
    """Completions: each choice's text starts with its prompt's (vLLM's echo); with logprobs,
    so do its logprobs."""
    prompt_only: bool = False
    """Echo with max_tokens 0 (vLLM's): each choice is its prompt alone (the token generated
    is left out)."""
    other_prompts: tuple[Prompt, ...] = ()
    """Completions: a batch's prompts after the first (`text`, `token_ids`), as (text, None) or
    (None, token ids). Choice j of prompt i is choice i * n + j of the response (vLLM's)."""

    def one_per_prompt(self) -> list[ApiRequest]:
        """This request once for each of its prompts, each with one prompt."""
        firsts = [(self.text, self.token_ids), *self.other_prompts]
        return [replace(self, text=text, token_ids=ids, other_prompts=()) for text, ids in firsts]


def parse(endpoint: Endpoint, raw: bytes, model: ServedModel) -> ApiRequest:
    """Checks a raw body sent to `endpoint` of a router serving `model`."""
    body = checked_body(raw, model, endpoint.parameters)
    for name, asks_nothing in endpoint.not_yet.items():
        if name in body and not asks_nothing(body[name]):
            raise RequestError(400, f"{name}: {body[name]!r} is not supported yet", name)
    text = token_ids = messages = template = tools = None
    others: tuple[Prompt, ...] = ()
    constraint = structured.structured_output(body)
    if endpoint is Endpoint.CHAT:
        messages = chat_messages(body.get("messages"))
        template = template_arguments(body)
        tools, constraint = _tools(body, model, template, constraint)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompts = _prompts(body.get("prompt"), model.vocab_size)
        (text, token_ids), others = prompts[0], prompts[1:]
        max_tokens = body.get("max_tokens", 16)
    echo = flag(body, "echo", False)
    prompt_only = echo and endpoint is Endpoint.COMPLETIONS and whole(max_tokens) == 0
    if prompt_only:  # vLLM's: the prompt alone, of one token generated and left out
        max_tokens = 1
    if max_tokens is not None:
        max_tokens = checked_max_tokens(max_tokens)
    stop_ids = body.get("stop_token_ids", [])
    if not (isinstance(stop_ids, list) and all(is_token_id(t, model.vocab_size)
                                               for t in stop_ids)):  # fmt: skip
        raise RequestError(400, f"stop_token_ids: a list of token ids below {model.vocab_size}",
                           "stop_token_ids")  # fmt: skip
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options: must be an object", "stream_options")
    sampling = _sampling(endpoint, body, model)
    n = integer(body, "n", 1, MAX_CHOICES + 1, 1)
    if others and (1 + len(others)) * n > MAX_CHOICES:
        raise RequestError(400, f"prompt: {1 + len(others)} prompts of {n} choices each, more "
                           f"than {MAX_CHOICES} choices", "prompt")  # fmt: skip
    _prompt_logprobs(endpoint, body, sampling, echo)
    if n > 1 and not sampling.temperature:  # 0: greedy
        raise RequestError(400, f"n: {n} choices need sampling (a temperature above 0); greedy "
                           "ones would all be the same", "n")  # fmt: skip
    return ApiRequest(
        endpoint=endpoint,
        text=text,
        token_ids=token_ids,
        messages=messages,
        template=template,
        max_tokens=max_tokens,
        sampling=sampling,
        structured=constraint,
        tools=tools,
        min_tokens=integer(body, "min_tokens", 0, 2**32, 0),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=flag(body, "ignore_eos", False),
        stops=stops(body.get("stop", [])),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output", False),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
        tokens_as_ids=flag(body, "return_tokens_as_token_ids", False),
        return_token_ids=flag(body, "return_token_ids", False),
        request_id=request_id(body.get("request_id")),
        include_reasoning=flag(body, "include_reasoning", True),
        add_special_tokens=flag(body, "add_special_tokens", endpoint is Endpoint.COMPLETIONS),
        stream=flag(body, "stream", False),
        include_usage=flag(options, "include_usage", False),
        n=n,
        echo=echo,
        prompt_only=prompt_only,
        other_prompts=others,
    )


def generation_request(
    request: ApiRequest, prompt_ids: list[int], max_model_len: int
) -> GenerationRequest:
    """The orchestrator's request, once the prompt is `prompt_ids`: checks that the prompt and
    max_tokens fit `max_model_len`."""
    if not prompt_ids:  # "" with a tokenizer that adds no BOS
        raise RequestError(400, "prompt: no tokens; a prompt needs at least one", "prompt")
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise RequestError(400, f"prompt of {len(prompt_ids)} tokens leaves no room in the "
                               f"context length {max_model_len}", "messages")  # fmt: skip
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            400,
            f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the context "
            f"length {max_model_len}",
            "max_tokens",
        )
    if request.min_tokens > max_tokens:
        raise RequestError(
            400, f"min_tokens: {request.min_tokens!r} not in [0, max_tokens]", "min_tokens"
        )
    return GenerationRequest(
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        sampling=request.sampling,
        min_tokens=request.min_tokens,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        structured=request.structured,
        n=request.n,
    )


def checked_body(raw: bytes, model: ServedModel, accepted: frozenset[str]) -> dict:
    """The JSON object in `raw` without its null fields, once it names no parameter outside
    `accepted` and no model but `model`."""
    body = {k: v for k, v in json_object(raw).items() if v is not None}
    unknown = sorted(set(body) - accepted)
    if unknown:
        raise RequestError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    if body.get("model", model.name) != model.name:
        raise RequestError(404, f"model {body['model']!r} not found (serving {model.name!r})",
                           "model")  # fmt: skip
    return body


def json_object(raw: bytes) -> dict:
    """The JSON object a request body holds; RequestError (400, 413) for anything else."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"body: {len(raw)} bytes, at most {MAX_BODY_BYTES}")
    try:
        return json_body.json_object(raw)
    except json_body.InvalidBody as e:
        raise RequestError(400, str(e)) from None


def _prompts(prompt, vocab_size: int) -> tuple[Prompt, ...]:
    """Each prompt of the body's `prompt`: a string, token ids, or a batch (a list of either),
    as (text, None) or (None, token ids)."""
    if isinstance(prompt, str):
        return ((prompt, None),)
    if isinstance(prompt, list) and prompt and all(is_token_id(t, vocab_size) for t in prompt):
        return ((None, prompt),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple((p, None) for p in prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            is_token_id(t, vocab_size) for t in p) for p in prompt):  # fmt: skip
        return tuple((None, p) for p in prompt)
    raise RequestError(400, "prompt: a string, a non-empty list of token ids below "
                       f"{vocab_size}, or a list of either", "prompt")  # fmt: skip


def _sampling(endpoint: Endpoint, body: dict, model: ServedModel) -> decode_pb2.SamplingParams:
    """The sampling fields the client set, then the model's defaults for those it did not
    (ServedModel.sampling_defaults: temperature always); the rest stay unset (the engine's
    neutral defaults). vLLM's conventions: top_k -1 is no limit; a negative seed is a 64-bit
    one; a logit bias is clamped to [-100, 100]."""
    sampling = decode_pb2.SamplingParams()
    for name in SAMPLING:
        if name not in body:
            continue
        value = seed(body[name]) if name == "seed" else body[name]
        try:
            setattr(sampling, name, checked_sampling_value(name, value))
        except ValueError as e:
            raise RequestError(400, str(e), name) from None
    logprobs = _logprobs(endpoint, body)
    if logprobs is not None:
        sampling.logprobs = logprobs
    sampling.logit_bias.update(logit_bias(body.get("logit_bias"), model.vocab_size))
    sampling.allowed_token_ids.extend(allowed_token_ids(body.get("allowed_token_ids"),
                                                        model.vocab_size))  # fmt: skip
    for name, value in model.sampling_defaults.items():
        if not sampling.HasField(name):
            setattr(sampling, name, value)
    return sampling


def _prompt_logprobs(
    endpoint: Endpoint, body: dict, sampling: decode_pb2.SamplingParams, echo: bool
) -> None:
    """vLLM's `prompt_logprobs` (and an echo with logprobs, which takes their count:
    completions' `logprobs`, chat's `top_logprobs`): the prompt's log-probabilities, in a body,
    not in a stream (vLLM refuses them there, and streams them only as a completions echo's)."""
    count = integer(body, "prompt_logprobs", 0, MAX_LOGPROBS + 1, None)
    streamed = flag(body, "stream", False)
    if count and streamed:
        raise RequestError(400, "prompt_logprobs: not available when stream is true",
                           "prompt_logprobs")  # fmt: skip
    if echo and endpoint is Endpoint.COMPLETIONS and sampling.HasField("logprobs"):
        count = sampling.logprobs if count is None else count
    elif echo and not streamed and count is None:  # chat's: in the body only
        count = integer(body, "top_logprobs", 0, MAX_LOGPROBS + 1, None)
    elif streamed:
        count = None  # 0: nothing to report
    if count is not None:
        sampling.prompt_logprobs = count


def _logprobs(endpoint: Endpoint, body: dict) -> int | None:
    """Alternatives per token the client asked for, or None: chat has `logprobs` (bool) and
    `top_logprobs`; completions' `logprobs` is the count."""
    if endpoint is Endpoint.COMPLETIONS:
        return integer(body, "logprobs", 0, MAX_LOGPROBS + 1, None)
    asked = flag(body, "logprobs", False)
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS + 1, None)
    if top is not None and not asked:
        raise RequestError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    return (top or 0) if asked else None


def _tools(body: dict, model: ServedModel, template: dict, constraint):
    """The tools (rendered by the template, as vLLM does, whatever tool_choice says) and the
    constraint: a forced call's schema, or the client's own."""
    tools = check_tools(*(body.get(name) for name in _TOOLS), model.auto_tools)
    if tools.tools:
        template["tools"] = template_tools(tools.tools)
    if not tools.constrained:
        return tools, constraint
    if constraint is not None:
        raise RequestError(400, "tool_choice: a forced tool call cannot be combined with "
                           "response_format or structured_outputs", "tool_choice")  # fmt: skip
    schema = tool_choice_schema(tools.tools, tools.tool_choice, tools.parallel_tool_calls)
    return tools, structured.json_schema(schema, "tools")
