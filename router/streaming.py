"""From token ids to OpenAI responses:

  Tokens, then a Finished  --text_events-->  Deltas (text, and the logprobs of the tokens it
      covers), then a Finished
      --sse-->      "data: {chunk}\\n\\n" events, then "data: [DONE]\\n\\n"   (stream: true)
      --collect-->  (Delta, Finished) --completion_body--> one JSON body         (stream: false)

Stop strings end the generation in `text_events` (and are not returned unless asked). A
BackendError raised mid-stream becomes an error event in `sse`; `collect` lets it through for an
HTTP status.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from proto.tandem.v1 import decode_pb2
from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError, error_body
from router.generation import Finished, Tokens
from router.logprobs import LogprobsFormat
from router.output_parsing import ChoiceParser
from router.requests import Endpoint


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int] = field(default_factory=list)
    """The tokens consumed since the previous Delta (output parsers read them)."""
    logprobs: list[tuple[int, decode_pb2.TokenLogprobs]] = field(default_factory=list)
    """(token id, its logprobs) of those tokens, when asked."""


async def text_events(
    tokens: AsyncIterator[Tokens | Finished],
    detok: IncrementalDetokenizer,
    prompt_tokens: int,
    stops: Sequence[str],
    include_stop: bool = False,
) -> AsyncIterator[Delta | Finished]:
    """Deltas, then a Finished counting `prompt_tokens` and the tokens consumed. Closes
    `tokens` however it ends: after a stop string, that aborts the generation upstream. The stop
    token that ended the generation adds no text unless `include_stop` (vLLM's
    include_stop_str_in_output)."""
    completion = 0
    held = ""  # text that could still be the start of a stop string
    ids: list[int] = []
    pending: list[tuple[int, decode_pb2.TokenLogprobs]] = []
    keep = max((len(s) - 1 for s in stops), default=0)
    try:
        async for item in tokens:
            if isinstance(item, Finished):
                if (tail := held + detok.flush()) or ids:
                    yield Delta(tail, ids, pending)
                yield Finished(item.finish_reason, prompt_tokens, completion)
                return
            completion += len(item.ids)
            ids.extend(item.ids)
            pending.extend(zip(item.ids, item.logprobs, strict=False))  # none unless asked
            shown = item.ids[:-1] if item.ends_on_stop_token and not include_stop else item.ids
            held += detok.add(shown)
            for stop in stops:
                if stop in held:
                    end = held.index(stop) + (len(stop) if include_stop else 0)
                    if held[:end] or ids:
                        yield Delta(held[:end], ids, pending)
                    yield Finished("stop", prompt_tokens, completion)
                    return
            if len(held) > keep:
                cut = len(held) - keep
                yield Delta(held[:cut], ids, pending)
                held, ids, pending = held[cut:], [], []
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
    logprobs: LogprobsFormat | None = None
    """Set when the client asked for logprobs."""
    parser: ChoiceParser | None = None
    """Chat: splits the text into content, reasoning and tool calls (router/output_parsing.py);
    None: the text is the content."""

    def head(self, chunk: bool) -> dict:
        kind = self.endpoint.chunk_object if chunk else self.endpoint.value
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs_of(self, delta: Delta) -> dict | None:
        return self.logprobs.render(delta.logprobs) if self.logprobs else None

    def finish_reason(self, reason: str) -> str:
        return self.parser.finish_reason(reason) if self.parser else reason


async def sse(events: AsyncIterator[Delta | Finished], response: Response) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta (none for text an output parser holds back), one
    with the finish reason, a usage chunk if asked, then [DONE]; a BackendError on the way ends
    it with an error event, then [DONE]."""
    head = response.head(chunk=True)
    first = True
    try:
        async with contextlib.aclosing(events):  # a client gone closes this, and `events`
            async for event in events:
                if isinstance(event, Finished):
                    reason = response.finish_reason(event.finish_reason)
                    choice = _chunk_choice(response, None, first, reason)
                    yield _event({**head, "choices": [choice]})
                    if response.include_usage:
                        yield _event({**head, "choices": [], "usage": _usage(event)})
                elif (choice := _chunk_choice(response, event, first, None)) is not None:
                    yield _event({**head, "choices": [choice]})
                    first = False
    except BackendError as e:
        yield _event(error_body(e.status, str(e)))
    yield "data: [DONE]\n\n"


async def collect(events: AsyncIterator[Delta | Finished]) -> tuple[Delta, Finished]:
    """The whole text, its tokens and every logprob, and the Finished; a BackendError
    propagates."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[tuple[int, decode_pb2.TokenLogprobs]] = []
    finish = None
    async for event in events:
        if isinstance(event, Finished):
            finish = event
        else:
            text.append(event.text)
            ids.extend(event.token_ids)
            logprobs.extend(event.logprobs)
    assert finish is not None, "an event stream ends with a Finished"
    return Delta("".join(text), ids, logprobs), finish


def completion_body(response: Response, whole: Delta, finish: Finished) -> dict:
    """The non-streaming response."""
    if response.endpoint is Endpoint.CHAT:
        fields = response.parser.whole(whole.text) if response.parser else {"content": whole.text}
        choice = {"index": 0, "message": {"role": "assistant", **_present(fields)}}
    else:
        choice = {"index": 0, "text": whole.text}
    choice.update(logprobs=response.logprobs_of(whole),
                  finish_reason=response.finish_reason(finish.finish_reason))  # fmt: skip
    return {**response.head(chunk=False), "choices": [choice], "usage": _usage(finish)}


def _chunk_choice(
    response: Response, delta: Delta | None, first: bool, finish: str | None
) -> dict | None:
    """The chunk's choice for `delta` (None: the end, with `finish`), or None when there is
    nothing to send (an output parser held the text back, and no logprobs came)."""
    logprobs = response.logprobs_of(delta) if delta and delta.logprobs else None
    if response.endpoint is not Endpoint.CHAT:
        text = delta.text if delta else ""
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    message = _chat_delta(response, delta)
    if message is None and logprobs is None and finish is None:
        return None
    message = message or ({"content": ""} if delta or not response.parser else {})
    if first:
        message = {"role": "assistant", **message}
    return {"index": 0, "delta": message, "logprobs": logprobs, "finish_reason": finish}


def _chat_delta(response: Response, delta: Delta | None) -> dict | None:
    if response.parser is None:
        return {"content": delta.text} if delta else None
    if delta is None:
        return response.parser.finish()
    return response.parser.feed(delta.text, delta.token_ids)


def _present(fields: dict) -> dict:
    """The message's fields without an absent reasoning."""
    return {k: v for k, v in fields.items() if v is not None or k == "content"}


def _usage(finish: Finished) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}  # fmt: skip


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
