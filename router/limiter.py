"""Admission by count (`--max-queue`): a request holds a slot from before its first backend call
until its last event is consumed or it is cancelled; past the limit a request is refused at
once (the API answers 429 with Retry-After) rather than queued behind the others."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class QueueFull(Exception):
    """Every slot is taken; `active` requests are in flight."""

    def __init__(self, active: int) -> None:
        super().__init__(f"{active} requests in flight, the limit")
        self.active = active


class InFlightLimiter:
    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit: {limit} must be >= 0 (0: no limit)")
        self.limit = limit
        """Requests in flight at most; 0: no limit (they are still counted)."""
        self.active = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Holds one slot for the `with` block; raises QueueFull when none is free.
        NOTE: the check and the count happen in one step with no await between them, so
        concurrent requests on one event loop cannot all slip past the limit."""
        if self.limit and self.active >= self.limit:
            raise QueueFull(self.active)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
