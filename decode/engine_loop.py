"""The engine's own thread: it alone steps the LLMEngine; RPC threads talk to it through a
command queue and read tokens from one stream per request.

  submit(seq, blocks, first_token) -> TokenStream   (the sequence joins the running batch)
  abort(seq_id)                                     (client gone: the sequence is dropped)

A stream yields lists of new token ids (everything generated since the reader last looked, so
a slow reader gets several per message) and ends with the finish reason.

If the engine raises (a CUDA error, a bug), its state is lost: every open stream ends with
EngineFailed at once, and so does every later submit, instead of waiting on a stream that no
step will feed. `failure` then says what happened; the server must be restarted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.sequence import FinishReason, Sequence

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class EngineFailed:
    message: str


class TokenStream:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int | Finished | EngineFailed] = queue.SimpleQueue()

    def put(self, item: int | Finished | EngineFailed) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[list[int] | Finished | EngineFailed]:
        """Batches of token ids as they come, then one Finished or EngineFailed."""
        while True:
            batch: list[int] = []
            item = self._queue.get()
            while True:
                if isinstance(item, Finished | EngineFailed):
                    if batch:
                        yield batch
                    yield item
                    return
                batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            yield batch


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[Sequence, TokenStream]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.failure: str | None = None
        """Set once the engine raised: why, and what to do."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence, block_ids: list[int], first_token: int) -> TokenStream:
        stream = TokenStream()
        self._commands.put(("add", seq, block_ids, first_token, stream))
        self._wake.set()
        return stream

    def abort(self, seq_id: str) -> None:
        self._commands.put(("abort", seq_id))
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as error:
            _log.exception("decode engine failed; failing every stream")
            self.failure = (
                f"decode engine failed: {type(error).__name__}: {error} "
                "(its state is lost: restart the decode server)"
            )
            for seq_id in list(self._live):
                self._live.pop(seq_id)[1].put(EngineFailed(self.failure))
            self._refuse_until_stopped()

    def _serve(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.engine.has_unfinished:
                self._wait()
                continue
            for out in self.engine.step():
                if out.seq_id in self._live:
                    self._live[out.seq_id][1].put(out.token_id)
                    if out.finish_reason is not None:
                        self._finish(out.seq_id, out.finish_reason)

    def _refuse_until_stopped(self) -> None:
        """After a failure: every submit (queued or still to come) ends with it at once."""
        while not self._stopped:
            for command in self._queued_commands():
                if command[0] == "add":
                    command[-1].put(EngineFailed(self.failure))
            self._wait()

    def _queued_commands(self) -> Iterator[tuple]:
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _wait(self) -> None:
        self._wake.wait(timeout=0.5)
        self._wake.clear()

    def _drain_commands(self) -> None:
        for command in self._queued_commands():
            if command[0] == "add":
                _, seq, block_ids, first_token, stream = command
                self._live[seq.seq_id] = (seq, stream)
                stream.put(first_token)
                if not self.engine.add_prefilled(seq, block_ids, first_token):
                    self._finish(seq.seq_id, seq.finish_reason)
            elif self.engine.abort(command[1]):
                self._finish(command[1], FinishReason.ABORT)

    def _finish(self, seq_id: str, reason: FinishReason) -> None:
        seq, stream = self._live.pop(seq_id)
        stream.put(Finished(reason, seq.num_prompt_tokens, seq.num_output_tokens))
