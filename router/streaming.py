"""From token ids to OpenAI responses:

  lists of token ids, then a Finished  --text_events-->  text deltas, then a Finished
      --sse-->      "data: {chunk}\\n\\n" events, then "data: [DONE]\\n\\n"   (stream: true)
      --collect-->  (text, Finished) --completion_body--> one JSON body      (stream: false)

Stop strings end the generation in `text_events` (and are not returned). A BackendError raised
mid-stream becomes an error event in `sse`; `collect` lets it through for an HTTP status.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence

from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError, error_body
from router.generation import Finished
from router.requests import Endpoint


async def text_events(
    tokens: AsyncIterator[list[int] | Finished],
    detok: IncrementalDetokenizer,
    prompt_tokens: int,
    stops: Sequence[str],
) -> AsyncIterator[str | Finished]:
    """Text deltas, then a Finished counting `prompt_tokens` and the tokens consumed. Closes
    `tokens` however it ends: after a stop string, that aborts the generation upstream."""
    completion = 0
    held = ""  # text that could still be the start of a stop string
    keep = max((len(s) - 1 for s in stops), default=0)
    try:
        async for item in tokens:
            if isinstance(item, Finished):
                if tail := held + detok.flush():
                    yield tail
                yield Finished(item.finish_reason, prompt_tokens, completion)
                return
            completion += len(item)
            held += detok.add(item)
            for stop in stops:
                if stop in held:
                    if text := held[: held.index(stop)]:
                        yield text
                    yield Finished("stop", prompt_tokens, completion)
                    return
            if len(held) > keep:
                cut = len(held) - keep
                yield held[:cut]
                held = held[cut:]
    finally:
        await tokens.aclose()


async def sse(
    events: AsyncIterator[str | Finished],
    endpoint: Endpoint,
    response_id: str,
    model: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per text delta, one with the finish reason, a usage chunk if
    asked, then [DONE]; a BackendError on the way ends it with an error event, then [DONE]."""
    head = {"id": response_id, "object": endpoint.chunk_object, "created": created,
            "model": model}  # fmt: skip
    first = True
    try:
        async with contextlib.aclosing(events):  # a client gone closes this, and `events`
            async for event in events:
                if isinstance(event, Finished):
                    choice = _chunk_choice(endpoint, "", first, event.finish_reason)
                    yield _event({**head, "choices": [choice]})
                    if include_usage:
                        yield _event({**head, "choices": [], "usage": _usage(event)})
                else:
                    choice = _chunk_choice(endpoint, event, first, None)
                    yield _event({**head, "choices": [choice]})
                    first = False
    except BackendError as e:
        yield _event(error_body(e.status, str(e)))
    yield "data: [DONE]\n\n"


async def collect(events: AsyncIterator[str | Finished]) -> tuple[str, Finished]:
    """The whole text and the Finished; a BackendError propagates."""
    text: list[str] = []
    finish = None
    async for event in events:
        if isinstance(event, Finished):
            finish = event
        else:
            text.append(event)
    assert finish is not None, "an event stream ends with a Finished"
    return "".join(text), finish


def completion_body(
    endpoint: Endpoint, response_id: str, model: str, created: int, text: str, finish: Finished
) -> dict:
    """The non-streaming response."""
    if endpoint is Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish.finish_reason}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": finish.finish_reason}  # fmt: skip
    return {"id": response_id, "object": endpoint.value, "created": created, "model": model,
            "choices": [choice], "usage": _usage(finish)}  # fmt: skip


def _chunk_choice(endpoint: Endpoint, text: str, first: bool, finish: str | None) -> dict:
    if endpoint is Endpoint.CHAT:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _usage(finish: Finished) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}  # fmt: skip


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
