"""Drives the conversations against the server.

A conversation is the unit of load: at most `max_concurrency` run at once, started as soon as a
slot frees or, with a finite `request_rate`, at Poisson arrivals of that many per second (a random
request is a one-turn conversation, so for the random dataset both count requests, as in
`vllm bench serve`). A conversation's turns go in order, each request carrying the whole history
with the assistant's actual replies; a failed turn ends its conversation (an agent cannot go on
without the reply), and its remaining turns are counted as not sent.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from tools.bench.client import RequestResult, send
from tools.bench.datasets import Conversation, Endpoint
from tools.bench.progress import Progress


@dataclass(frozen=True)
class Load:
    max_concurrency: int | None
    """Conversations in flight at most; None: no limit."""
    request_rate: float
    """Conversation starts per second (Poisson arrivals); inf: all at once."""
    seed: int
    """Seeds the arrival times."""


@dataclass(frozen=True)
class RunResult:
    results: list[RequestResult]
    """One per request sent, in completion order."""
    duration: float
    """Seconds from the first request to the last response."""
    server_phases_ms: dict[str, float] = field(default_factory=dict)
    """The mean of each step the server reports timing (tools/bench/server_phases.py)."""


async def warm_up(
    http: httpx.AsyncClient, conversations: list[Conversation], body_fields: dict, warmups: int
) -> None:
    """Untimed, one at a time: the first `warmups` conversations' first turns. A server's first
    requests pay its one-time costs (kernels compiled for new shapes, connections made), which
    neither the results nor the server's own phase timings should count."""
    for index, conversation in enumerate(conversations[:warmups]):
        body = {**body_fields, **_payload(conversation, 0, [])}
        await send(http, conversation.endpoint.value, body, conversation=index, turn=0,
                   t0=time.perf_counter())  # fmt: skip


async def run(
    http: httpx.AsyncClient,
    conversations: list[Conversation],
    load: Load,
    body_fields: dict,
    progress: Progress,
) -> RunResult:
    """`body_fields` go into every request (model, sampling parameters, ...)."""
    slots = asyncio.Semaphore(load.max_concurrency or len(conversations) or 1)
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def one(index: int, conversation: Conversation, arrival: float) -> None:
        await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        async with slots:
            history: list[dict] = []
            for turn_index, turn in enumerate(conversation.turns):
                body = {**body_fields, **_payload(conversation, turn_index, history)}
                result = await send(http, conversation.endpoint.value, body,
                                    conversation=index, turn=turn_index, t0=t0)  # fmt: skip
                results.append(result)
                if not result.ok:
                    progress.advance(len(conversation.turns) - turn_index, errors=1)
                    return
                progress.advance()
                history += [{"role": "user", "content": turn.text},
                            {"role": "assistant", "content": result.text}]  # fmt: skip

    arrivals = _arrivals(len(conversations), load.request_rate, random.Random(load.seed))
    await asyncio.gather(
        *(one(i, c, a) for i, (c, a) in enumerate(zip(conversations, arrivals, strict=True)))
    )
    return RunResult(results, time.perf_counter() - t0)


def _payload(conversation: Conversation, turn_index: int, history: list[dict]) -> dict:
    turn = conversation.turns[turn_index]
    fields = {"max_tokens": turn.output_len, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    if conversation.endpoint is Endpoint.COMPLETIONS:
        return {**fields, "prompt": turn.text}
    system = [{"role": "system", "content": conversation.system}] if conversation.system else []
    return {**fields, "messages": [*system, *history, {"role": "user", "content": turn.text}]}


def _arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Start times in seconds: all 0 at an infinite rate, else a Poisson process."""
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        if rate != float("inf"):
            now += rng.expovariate(rate)
    return times
