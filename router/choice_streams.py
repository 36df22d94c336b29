"""Event streams of several generations made one response's: a completions batch's prompts
merged (`batched`), and vLLM's echo put before each choice's events (`echoed`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from router.generation import Finished, PromptLogprobs
from router.streaming import Delta, Event


def batched(streams: Sequence[AsyncIterator[Event]], n: int) -> AsyncIterator[Event]:
    """The events of a completions batch's prompts (each stream a prompt's, of n choices), as
    they come, prompt i's choice j renumbered i * n + j (vLLM's); a lone stream as it is."""
    return streams[0] if len(streams) == 1 else _merged(streams, n)


async def echoed(
    events: AsyncIterator[Event], prompts: Sequence[str], n: int, prompt_only: bool = False
) -> AsyncIterator[Event]:
    """vLLM's echo: each choice's events after a Delta of its prompt's text (choice i's prompt
    is prompts[i // n]), so a body's text and a stream's first chunk start with it; with the
    prompt's log-probabilities where they came (the first token's None). `prompt_only`
    (max_tokens 0): the generated text is left out."""
    started: set[int] = set()
    prompt_logprobs: dict[int, PromptLogprobs] = {}
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, PromptLogprobs):  # before the choice's first event
                prompt_logprobs[event.index] = event
                yield event
                continue
            if event.index not in started:
                started.add(event.index)
                yield _echo(prompts[event.index // n], prompt_logprobs.get(event.index), event)
            if not (prompt_only and isinstance(event, Delta)):
                yield event


def _echo(text: str, prompt: PromptLogprobs | None, before: Delta | Finished) -> Delta:
    if prompt is None:
        return Delta(text, index=before.index)
    ids = prompt.prompt_ids
    entries = [(ids[0], None), *zip(ids[1:], prompt.entries, strict=True)]
    return Delta(text, logprobs=entries, index=before.index)


async def _merged(streams: Sequence[AsyncIterator[Event]], n: int) -> AsyncIterator[Event]:
    """The first error of any stream ends it, raised; however it ends, every stream is closed
    (their generations aborted where not done)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(prompt: int, stream: AsyncIterator[Event]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    await queue.put(replace(event, index=prompt * n + event.index))
        except Exception as e:  # the consumer raises it
            await queue.put(e)
            return
        await queue.put(None)  # this stream's end

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        live = len(pumps)
        while live:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                live -= 1
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
