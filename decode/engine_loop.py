"""The decode server's engine thread (engine.engine_thread): it alone steps the LLMEngine; RPC
threads talk to it through a command queue and read tokens from one stream per request.

  submit(seq, blocks, first_token) -> TokenStream   (the sequence joins the running batch)
  abort(seq_id)                                     (client gone: the sequence is dropped)

A stream yields lists of new token ids (everything generated since the reader last looked, so
a slow reader gets several per message) and ends with the finish reason.

If the engine raises (a CUDA error, a bug), its state is lost: every open stream ends with
EngineFailed at once, and so does every later submit, instead of waiting on a stream that no
step will feed. `failure` then says what happened; the server must be restarted.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass

from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.sequence import FinishReason, Sequence


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


class EngineLoop(EngineThread):
    def __init__(self, engine: LLMEngine) -> None:
        self._live: dict[str, tuple[Sequence, TokenStream]] = {}
        super().__init__(engine, server="decode", thread_name="engine-loop")

    def submit(self, seq: Sequence, block_ids: list[int], first_token: int) -> TokenStream:
        stream = TokenStream()
        self._put(("add", seq, block_ids, first_token, stream))
        return stream

    def abort(self, seq_id: str) -> None:
        self._put(("abort", seq_id))

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    def _admit(self, command: tuple) -> None:
        if command[0] == "add":
            _, seq, block_ids, first_token, stream = command
            self._live[seq.seq_id] = (seq, stream)
            stream.put(first_token)
            if not self.engine.add_prefilled(seq, block_ids, first_token):
                self._finish(seq.seq_id, seq.finish_reason)
        elif self.engine.abort(command[1]):
            self._finish(command[1], FinishReason.ABORT)

    def _step(self) -> None:
        for out in self.engine.step():
            if out.seq_id in self._live:
                self._live[out.seq_id][1].put(out.token_id)
                if out.finish_reason is not None:
                    self._finish(out.seq_id, out.finish_reason)

    def _fail_live(self, failure: str) -> None:
        for seq_id in list(self._live):
            self._live.pop(seq_id)[1].put(EngineFailed(failure))

    def _refuse(self, command: tuple, failure: str) -> None:
        if command[0] == "add":
            command[-1].put(EngineFailed(failure))

    def _finish(self, seq_id: str, reason: FinishReason) -> None:
        seq, stream = self._live.pop(seq_id)
        stream.put(Finished(reason, seq.num_prompt_tokens, seq.num_output_tokens))
