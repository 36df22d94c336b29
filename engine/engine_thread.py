"""The thread a server steps its engine on (the decode server's loop, the prefill worker).

Requests reach the thread through a queue (`_put`); it admits what the queue holds (`_admit`),
steps the engine while it has work (`_step`), and otherwise sleeps until a `_put` or `stop`
wakes it. The engine is touched by this thread only.

If the engine raises (a CUDA error, a bug), its state is lost. Rather than leave callers
waiting on steps that will never come, the thread sets `failure` (the error, and that the
server must be restarted) and ends every live request with it (`_fail_live`); then, with
`_refuse`, the item whose admission raised (if that is what failed) and every queued or later
item, at once, until it is stopped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

from engine.llm_engine import LLMEngine

__all__ = ["EngineThread"]

_log = logging.getLogger(__name__)


class EngineThread:
    """Subclasses set up their own state, then call this __init__ last: the thread starts
    here."""

    def __init__(self, engine: LLMEngine, server: str, thread_name: str) -> None:
        self.engine = engine
        self.failure: str | None = None
        """Set once the engine raised: why, and what to do."""
        self._server = server
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _put(self, item: object) -> None:
        self._queue.put(item)
        self._wake.set()

    # What a subclass does with its items and the engine.

    def _admit(self, item: object) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        """One engine step, and its outputs handed to their requests."""
        raise NotImplementedError

    def _fail_live(self, failure: str) -> None:
        raise NotImplementedError

    def _refuse(self, item: object, failure: str) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        admitting = None
        try:
            while not self._stopped:
                for admitting in self._queued():
                    self._admit(admitting)
                admitting = None
                self.engine.check_ranks()  # a tensor-parallel rank gone fails the engine
                if self.engine.has_unfinished:
                    self._step()
                else:
                    self._wait()
        except Exception as error:
            _log.exception("%s engine failed; failing every request", self._server)
            self.failure = (
                f"{self._server} engine failed: {type(error).__name__}: {error} "
                f"(its state is lost: restart the {self._server} server)"
            )
            self._fail_live(self.failure)
            if admitting is not None:  # its admission raised: neither queued nor live now
                self._refuse(admitting, self.failure)
            while not self._stopped:
                for item in self._queued():
                    self._refuse(item, self.failure)
                self._wait()

    def _queued(self) -> Iterator:
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def _wait(self) -> None:
        self._wake.wait(timeout=0.5)
        self._wake.clear()
