"""From token ids to OpenAI responses:

  Tokens and a Finished per choice  --text_events-->  Deltas (text, and the logprobs of the
      tokens it covers) and a Finished per choice, each with its choice's index
      --sse-->      "data: {chunk}\\n\\n" events, then "data: [DONE]\\n\\n"   (stream: true)
      --collect-->  (Delta, Finished) per choice --completion_body--> one JSON body (stream: false)

Stop strings end a choice in `text_events` (and are not returned unless asked); the decode
server is told to stop it. A BackendError raised mid-stream becomes an error event in `sse`;
`collect` lets it through for an HTTP status. Several generations' events become one
response's in router/choice_streams.py (a batch, an echo).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from engine.openai_logprobs import prompt_logprobs_field
from proto.tandem.v1 import decode_pb2
from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError, error_body
from router.generation import Finished, PromptLogprobs, Tokens
from router.logprobs import LogprobsFormat
from router.output_parsing import ChoiceParser
from router.requests import Endpoint


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    """The tokens consumed since the previous Delta (output parsers read them)."""
    logprobs: list[tuple[int, decode_pb2.TokenLogprobs | None]] = field(default_factory=list)
    """(token id, its logprobs) of those tokens, when asked (None: the prompt's first token,
    echoed)."""
    index: int = 0
    """The choice."""
    prompt: PromptLogprobs | None = None
    """A whole choice's (`collect`), when the request asks for the prompt's."""


Event = Delta | Finished | PromptLogprobs


class ChoiceText:
    """One choice's tokens as text: `add` and `end` return its next Deltas, and its Finished
    (counting `prompt_tokens` and the tokens consumed) once it is `done`. A stop string ends it
    (the stop token that ended a generation adds no text unless `include_stop`: vLLM's
    include_stop_str_in_output)."""

    def __init__(
        self,
        index: int,
        detok: IncrementalDetokenizer,
        prompt_tokens: int,
        stops: Sequence[str],
        include_stop: bool = False,
    ) -> None:
        self.index = index
        self.detok = detok
        self.prompt_tokens = prompt_tokens
        self.stops = stops
        self.include_stop = include_stop
        self.done = False
        self.completion = 0
        self._held = ""  # text that could still be the start of a stop string
        self._keep = max((len(s) - 1 for s in stops), default=0)
        self._ids: list[int] = []
        self._pending: list[tuple[int, decode_pb2.TokenLogprobs]] = []

    def add(self, tokens: Tokens) -> list[Delta | Finished]:
        self.completion += len(tokens.ids)
        self._ids.extend(tokens.ids)
        self._pending.extend(zip(tokens.ids, tokens.logprobs, strict=False))  # none unless asked
        stop_token = tokens.ends_on_stop_token and not self.include_stop
        self._held += self.detok.add(tokens.ids[:-1] if stop_token else tokens.ids)
        for stop in self.stops:
            if stop in self._held:
                end = self._held.index(stop) + (len(stop) if self.include_stop else 0)
                return self._last(self._held[:end], "stop")
        if len(self._held) <= self._keep:
            return []
        cut = len(self._held) - self._keep
        return [self._delta(cut)]

    def end(self, finished: Finished) -> list[Delta | Finished]:
        """The choice's end, as the decode server reported it."""
        text = self._held + self.detok.flush()
        return self._last(text, finished.finish_reason, finished.spec_decode)

    def _delta(self, cut: int) -> Delta:
        delta = Delta(self._held[:cut], self._ids, self._pending, self.index)
        self._held, self._ids, self._pending = self._held[cut:], [], []
        return delta

    def _last(self, text: str, reason: str, spec=None) -> list[Delta | Finished]:
        self.done = True
        events: list[Delta | Finished] = []
        if text or self._ids:
            events.append(Delta(text, self._ids, self._pending, self.index))
        finished = Finished(reason, self.prompt_tokens, self.completion, self.index, spec)
        return [*events, finished]


async def text_events(
    tokens: AsyncIterator[Tokens | Finished | PromptLogprobs],
    choices: Sequence[ChoiceText],
    stop_choice: Callable[[int], Awaitable[None]] | None = None,
) -> AsyncIterator[Event]:
    """Every choice's Deltas, then its Finished, until all are done. A choice ended by a stop
    string is stopped upstream (`stop_choice`), and whatever it still sends is passed over.
    Closes `tokens` however it ends: once every choice is done, that aborts what is left."""
    live = len(choices)
    try:
        async for item in tokens:
            if isinstance(item, PromptLogprobs):  # the echo and the body's, before any token
                yield item
                continue
            choice = choices[item.index]
            if choice.done:
                continue
            events = choice.end(item) if isinstance(item, Finished) else choice.add(item)
            for event in events:
                yield event
            if choice.done:
                live -= 1
                if not live:
                    return
                if stop_choice is not None and not isinstance(item, Finished):
                    await stop_choice(choice.index)
    finally:
        await tokens.aclose()


@dataclass(frozen=True)
class Response:
    """What every chunk or body of one response says besides its text."""

    endpoint: Endpoint
    id: str
    model: str
    created: int
    include_usage: bool = False
    """Streaming: a last chunk with the usage."""
    logprobs: tuple[LogprobsFormat, ...] = ()
    """One per choice when the client asked for logprobs; none otherwise."""
    parsers: tuple[ChoiceParser, ...] = ()
    """Chat: one per choice, splitting its text into content, reasoning and tool calls
    (router/output_parsing.py); none: the text is the content."""
    spec_metrics: bool = False
    """A one-choice response carries its speculative decoding under `metrics` (vLLM's
    --per-request-spec-decode-metrics summary): the body's, or the usage chunk's."""
    n: int = 1
    """Choices per prompt (a completions batch has several prompts): the usage counts each
    prompt's tokens once."""
    token_text: Callable[[int], str] | None = None
    """Names the tokens of the prompt's log-probabilities (engine.openai_logprobs.token_texts),
    when the request asks for them."""
    prompt_token_ids: tuple[list[int], ...] = ()
    """vLLM's return_token_ids: each prompt's token ids (a batch's in order), and every
    choice's own are returned; empty: not asked."""

    chat_echo: str = ""
    """A chat's `echo`: each choice's content starts with it (router.messages.echoed_text)."""

    def token_ids_of(self, index: int, ids: list[int], first: bool) -> dict:
        """Choice `index`'s token ids (and, completions' first, its prompt's), where asked."""
        if not self.prompt_token_ids:
            return {}
        if first and self.endpoint is Endpoint.COMPLETIONS:
            return {"prompt_token_ids": self.prompt_token_ids[index // self.n], "token_ids": ids}
        return {"token_ids": ids}

    def head(self, chunk: bool) -> dict:
        kind = self.endpoint.chunk_object if chunk else self.endpoint.value
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs_of(self, delta: Delta) -> dict | None:
        return self.logprobs[delta.index].render(delta.logprobs) if self.logprobs else None

    def prompt_logprobs_of(self, prompt: PromptLogprobs) -> list[dict | None]:
        """vLLM's `prompt_logprobs` field."""
        return prompt_logprobs_field(prompt.prompt_ids, prompt.entries, self.token_text)

    def parser(self, index: int) -> ChoiceParser | None:
        return self.parsers[index] if self.parsers else None

    def finish_reason(self, finish: Finished) -> str:
        parser = self.parser(finish.index)
        return parser.finish_reason(finish.finish_reason) if parser else finish.finish_reason


async def sse(events: AsyncIterator[Event], response: Response) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta (none for text an output parser holds back) and
    one with the finish reason, per choice; a usage chunk if asked, then [DONE]. A BackendError
    on the way ends it with an error event, then [DONE]."""
    head = response.head(chunk=True)
    if response.endpoint is Endpoint.CHAT and response.prompt_token_ids:  # the first chunk's
        first_head = {**head, "prompt_token_ids": response.prompt_token_ids[0]}
    else:
        first_head = head
    started: set[int] = set()
    """Choices with a chunk sent: the first one carries the role."""
    sent = False
    finished: list[Finished] = []
    try:
        async with contextlib.aclosing(events):  # a client gone closes this, and `events`
            async for event in events:
                if isinstance(event, PromptLogprobs):  # streamed only as an echo's
                    continue
                first = event.index not in started
                if first and response.chat_echo:  # vLLM's: a chunk of it first
                    echo = {"role": "assistant", "content": response.chat_echo}
                    choice = {"index": event.index, "delta": echo, "logprobs": None,
                              "finish_reason": None}  # fmt: skip
                    yield _event({**(head if sent else first_head), "choices": [choice]})
                    started.add(event.index)
                    sent, first = True, False
                if isinstance(event, Finished):
                    finished.append(event)
                    reason = response.finish_reason(event)
                    choice = _chunk_choice(response, event.index, None, first, reason)
                elif (choice := _chunk_choice(response, event.index, event, first)) is None:
                    continue
                else:
                    started.add(event.index)
                yield _event({**(head if sent else first_head), "choices": [choice]})
                sent = True
        if response.include_usage:
            usage = {**head, "choices": [], "usage": _usage(finished, response.n)}
            yield _event({**usage, **_metrics(response, finished)})
    except BackendError as e:
        yield _event(error_body(e.status, str(e)))
    yield "data: [DONE]\n\n"


async def collect(events: AsyncIterator[Event]) -> list[tuple[Delta, Finished]]:
    """Each choice's whole text, its tokens and every logprob (one Delta, with the prompt's
    log-probabilities where they came), and its Finished, in choice order; a BackendError
    propagates."""
    deltas: dict[int, list[Delta]] = {}
    finished: dict[int, Finished] = {}
    prompts: dict[int, PromptLogprobs] = {}
    async for event in events:
        if isinstance(event, Finished):
            finished[event.index] = event
        elif isinstance(event, PromptLogprobs):
            prompts[event.index] = event
        else:
            deltas.setdefault(event.index, []).append(event)
    return [(_joined(deltas.get(i, []), i, prompts.get(i)), finished[i]) for i in sorted(finished)]


def completion_body(response: Response, choices: list[tuple[Delta, Finished]]) -> dict:
    """The non-streaming response."""
    bodies = [_whole_choice(response, whole, finish) for whole, finish in choices]
    finished = [finish for _, finish in choices]
    body = {**response.head(chunk=False), "choices": bodies, "usage": _usage(finished, response.n)}
    if response.endpoint is Endpoint.CHAT and response.prompt_token_ids:  # vLLM's: the response's
        body["prompt_token_ids"] = response.prompt_token_ids[0]
    prompt = choices[0][0].prompt if choices else None
    if response.endpoint is Endpoint.CHAT and prompt is not None:  # vLLM's: the response's
        body["prompt_logprobs"] = response.prompt_logprobs_of(prompt)
    return {**body, **_metrics(response, finished)}


def _joined(deltas: list[Delta], index: int, prompt: PromptLogprobs | None) -> Delta:
    return Delta("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                 [lp for d in deltas for lp in d.logprobs], index, prompt)  # fmt: skip


def _whole_choice(response: Response, whole: Delta, finish: Finished) -> dict:
    index = whole.index
    if response.endpoint is Endpoint.CHAT:
        parser = response.parser(index)
        fields = parser.whole(whole.text) if parser else {"content": whole.text}
        if response.chat_echo:  # vLLM's: before the content, whatever the parsers found
            fields["content"] = response.chat_echo + (fields.get("content") or "")
        choice = {"index": index, "message": {"role": "assistant", **_present(fields)}}
    else:
        choice = {"index": index, "text": whole.text}
    choice.update(
        logprobs=response.logprobs_of(whole), finish_reason=response.finish_reason(finish)
    )
    if response.endpoint is Endpoint.COMPLETIONS and whole.prompt is not None:  # each choice's
        choice["prompt_logprobs"] = response.prompt_logprobs_of(whole.prompt)
    return {**choice, **response.token_ids_of(index, whole.token_ids, first=True)}


def _chunk_choice(
    response: Response, index: int, delta: Delta | None, first: bool, finish: str | None = None
) -> dict | None:
    """Choice `index`'s part of a chunk for `delta` (None: its end, with `finish`), or None when
    there is nothing to send (an output parser held the text back, and no logprobs or token ids
    asked for came)."""
    logprobs = response.logprobs_of(delta) if delta and delta.logprobs else None
    ids = response.token_ids_of(index, delta.token_ids if delta else [], first)
    if response.endpoint is not Endpoint.CHAT:
        text = delta.text if delta else ""
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, **ids}
    parser = response.parser(index)
    message = _chat_delta(parser, delta)
    if message is None and logprobs is None and finish is None and not ids.get("token_ids"):
        return None
    message = message or ({"content": ""} if delta or not parser else {})
    if first:
        message = {"role": "assistant", **message}
    return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish, **ids}


def _chat_delta(parser: ChoiceParser | None, delta: Delta | None) -> dict | None:
    if parser is None:
        return {"content": delta.text} if delta else None
    if delta is None:
        return parser.finish()
    return parser.feed(delta.text, delta.token_ids)


def _present(fields: dict) -> dict:
    """The message's fields without an absent reasoning."""
    return {k: v for k, v in fields.items() if v is not None or k == "content"}


def _usage(finished: list[Finished], n: int) -> dict:
    """Every choice's completion tokens, each prompt's once (vLLM's usage for n > 1 and for a
    batch: choice i * n is prompt i's first)."""
    prompt = sum(f.prompt_tokens for f in finished if f.index % n == 0)
    completion = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _metrics(response: Response, finished: list[Finished]) -> dict:
    """{"metrics": {"speculative_decoding": ...}} as vLLM's per-request summary has it, for a
    one-choice response whose decode server speculated; {} otherwise."""
    if not (response.spec_metrics and len(finished) == 1 and finished[0].spec_decode):
        return {}
    stats = finished[0].spec_decode
    histogram = list(stats.acceptance_histogram)
    steps = sum(histogram)
    accepted = sum(j * count for j, count in enumerate(histogram))
    drafted = stats.num_draft_tokens
    spec = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": len(histogram) - 1,
    }
    return {"metrics": {"speculative_decoding": spec}}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
