"""The --max-queue limiter: at most `limit` slots held at once, given back however the holder
ends, and no way for concurrent requests to slip past the limit together."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.limiter import InFlightLimiter, QueueFull


def test_slots_up_to_the_limit_then_queue_full_until_one_is_given_back():
    limiter = InFlightLimiter(2)
    with limiter.slot(), limiter.slot():
        assert limiter.active == 2
        with pytest.raises(QueueFull, match=r"^2 requests in flight, the limit$"), limiter.slot():
            pass
        assert limiter.active == 2  # a refusal holds nothing
    with limiter.slot():
        assert limiter.active == 1
    assert limiter.active == 0


def test_a_slot_is_given_back_when_its_holder_fails():
    limiter = InFlightLimiter(1)
    with contextlib.suppress(RuntimeError), limiter.slot():
        raise RuntimeError("backend failed")
    assert limiter.active == 0


def test_no_limit_still_counts():
    limiter = InFlightLimiter(0)
    with contextlib.ExitStack() as stack:
        for _ in range(1000):
            stack.enter_context(limiter.slot())
        assert limiter.active == 1000
    assert limiter.active == 0


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="limit"):
        InFlightLimiter(-1)


def test_concurrent_requests_cannot_slip_past_together():
    limiter = InFlightLimiter(3)
    admitted, refused = [], []
    release = asyncio.Event()

    async def request(i: int) -> None:
        try:
            with limiter.slot():
                admitted.append(i)
                await release.wait()
        except QueueFull:
            refused.append(i)

    async def main() -> None:
        tasks = [asyncio.create_task(request(i)) for i in range(10)]
        await asyncio.sleep(0)  # every task reaches its check before any gives a slot back
        assert limiter.active == 3
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert (len(admitted), len(refused), limiter.active) == (3, 7, 0)
