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
from router.requests import Endpoint


@dataclass(frozen=True)
class Delta:
    text: str
    logprobs: list[tuple[int, decode_pb2.TokenLogprobs]] = field(default_factory=list)
    """(token id, its logprobs) of the tokens consumed since the previous Delta, when asked."""


async def text_events(
    tokens: AsyncIterator[Tokens | Finished],
    detok: IncrementalDetokenizer,
    prompt_tokens: int,
    stops: Sequence[str],
    include_stop: bool = False,
) -> AsyncIterator[Delta | Finished]:
    """Deltas, then a Finished counting `prompt_tokens` and the tokens consumed. Closes
    `tokens` however it ends: after a stop string, that aborts the generation upstream."""
    completion = 0
    held = ""  # text that could still be the start of a stop string
    pending: list[tuple[int, decode_pb2.TokenLogprobs]] = []
    keep = max((len(s) - 1 for s in stops), default=0)
    try:
        async for item in tokens:
            if isinstance(item, Finished):
                if (tail := held + detok.flush()) or pending:
                    yield Delta(tail, pending)
                yield Finished(item.finish_reason, prompt_tokens, completion)
                return
            completion += len(item.ids)
            pending.extend(zip(item.ids, item.logprobs, strict=False))  # none unless asked
            held += detok.add(item.ids)
            for stop in stops:
                if stop in held:
                    end = held.index(stop) + (len(stop) if include_stop else 0)
                    if held[:end] or pending:
                        yield Delta(held[:end], pending)
                    yield Finished("stop", prompt_tokens, completion)
                    return
            if len(held) > keep:
                cut = len(held) - keep
                yield Delta(held[:cut], pending)
                held, pending = held[cut:], []
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

    def head(self, chunk: bool) -> dict:
        kind = self.endpoint.chunk_object if chunk else self.endpoint.value
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs_of(self, delta: Delta) -> dict | None:
        return self.logprobs.render(delta.logprobs) if self.logprobs else None


async def sse(events: AsyncIterator[Delta | Finished], response: Response) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta, one with the finish reason, a usage chunk if
    asked, then [DONE]; a BackendError on the way ends it with an error event, then [DONE]."""
    head = response.head(chunk=True)
    first = True
    try:
        async with contextlib.aclosing(events):  # a client gone closes this, and `events`
            async for event in events:
                if isinstance(event, Finished):
                    choice = _chunk_choice(response, Delta(""), first, event.finish_reason)
                    yield _event({**head, "choices": [choice]})
                    if response.include_usage:
                        yield _event({**head, "choices": [], "usage": _usage(event)})
                else:
                    choice = _chunk_choice(response, event, first, None)
                    yield _event({**head, "choices": [choice]})
                    first = False
    except BackendError as e:
        yield _event(error_body(e.status, str(e)))
    yield "data: [DONE]\n\n"


async def collect(events: AsyncIterator[Delta | Finished]) -> tuple[Delta, Finished]:
    """The whole text and every logprob, and the Finished; a BackendError propagates."""
    text: list[str] = []
    logprobs: list[tuple[int, decode_pb2.TokenLogprobs]] = []
    finish = None
    async for event in events:
        if isinstance(event, Finished):
            finish = event
        else:
            text.append(event.text)
            logprobs.extend(event.logprobs)
    assert finish is not None, "an event stream ends with a Finished"
    return Delta("".join(text), logprobs), finish


def completion_body(response: Response, whole: Delta, finish: Finished) -> dict:
    """The non-streaming response."""
    if response.endpoint is Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": whole.text}}
    else:
        choice = {"index": 0, "text": whole.text}
    choice.update(logprobs=response.logprobs_of(whole), finish_reason=finish.finish_reason)
    return {**response.head(chunk=False), "choices": [choice], "usage": _usage(finish)}


def _chunk_choice(response: Response, delta: Delta, first: bool, finish: str | None) -> dict:
    logprobs = response.logprobs_of(delta) if delta.logprobs else None
    if response.endpoint is Endpoint.CHAT:
        message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {"index": 0, "delta": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": 0, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}


def _usage(finish: Finished) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}  # fmt: skip


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
