"""A one-line progress bar on stderr: requests done out of planned, errors, elapsed time."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    WIDTH = 30
    REDRAW_S = 0.1  # at thousands of requests per second, redrawing each one would cost time

    def __init__(self, total: int, out: TextIO = sys.stderr) -> None:
        self._total, self._out = total, out
        self._done = self._errors = 0
        self._start = self._drawn = time.monotonic()
        self._draw()

    def advance(self, count: int = 1, errors: int = 0) -> None:
        """`count` requests finished (or given up), `errors` of them failed."""
        self._done += count
        self._errors += errors
        if time.monotonic() - self._drawn >= self.REDRAW_S:
            self._draw()

    def close(self) -> None:
        """Draws the final state and ends the line."""
        self._draw()
        self._out.write("\n")
        self._out.flush()

    def _draw(self) -> None:
        self._drawn = time.monotonic()
        filled = self.WIDTH * self._done // max(1, self._total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self._out.write(
            f"\r[{bar}] {self._done}/{self._total} requests, {self._errors} errors, "
            f"{self._drawn - self._start:.1f} s"
        )
        self._out.flush()
