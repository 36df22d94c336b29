"""One streaming OpenAI request (completions or chat), timed chunk by chunk.

Timings follow `vllm bench serve`: TTFT is the time to the first chunk carrying text, ITL the
gaps between successive text chunks, TPOT (E2E - TTFT) / (output tokens - 1), E2E the time to the
end of the stream. Output tokens come from the final `usage` chunk (`stream_options.include_usage`).
A failure becomes a result with an error kind, never an exception.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class RequestResult:
    conversation: int
    turn: int
    start: float
    """Seconds from the start of the run to sending the request."""
    error: str | None = None
    """None on success, else the kind: `http_<status>`, `stream_error`, `incomplete_stream`,
    `bad_response`, `timeout`, `connect_error` or `transport_error`."""
    detail: str = ""
    """The error's message."""
    ttft: float = 0.0
    """Seconds; all timings are 0 on failure."""
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    """From `usage`; None when the server reported none."""
    output_tokens: int = 0
    """From `usage`, or the number of text chunks when the server reported none."""
    text: str = ""
    """The generated text (the assistant's reply, for the next turn of a conversation)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None below two tokens or on failure."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(
    http: httpx.AsyncClient, path: str, body: dict, *, conversation: int, turn: int, t0: float
) -> RequestResult:
    """POSTs `body` (with `stream: true`) to `path` and times the stream; `t0` is the run's
    start on the `time.perf_counter` clock."""
    start = time.perf_counter()
    tag = {"conversation": conversation, "turn": turn, "start": start - t0}
    ttft, last, itl, pieces, usage = None, start, [], [], None
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                return RequestResult(**tag, error=f"http_{response.status_code}", detail=detail)
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event or event.get("object") == "error":  # older vLLM: the latter
                    error = event.get("error") or event
                    detail = str(error.get("message", error))
                    return RequestResult(**tag, error="stream_error", detail=detail)
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    pieces.append(piece)
            if not done:
                return RequestResult(**tag, error="incomplete_stream", detail="no [DONE]")
        e2e = time.perf_counter() - start
        return RequestResult(
            **tag,
            ttft=e2e if ttft is None else ttft,
            e2e=e2e,
            itl=itl,
            prompt_tokens=usage["prompt_tokens"] if usage else None,
            output_tokens=usage["completion_tokens"] if usage else len(pieces),
            text="".join(pieces),
        )
    except httpx.TimeoutException as e:
        return RequestResult(**tag, error="timeout", detail=repr(e))
    except httpx.ConnectError as e:
        return RequestResult(**tag, error="connect_error", detail=repr(e))
    except httpx.HTTPError as e:  # the connection broke mid-stream, a malformed response, ...
        return RequestResult(**tag, error="transport_error", detail=repr(e))
    except (ValueError, LookupError, AttributeError, TypeError) as e:  # not the API's JSON
        return RequestResult(**tag, error="bad_response", detail=repr(e))
