"""The decode server's engine thread (engine.engine_thread): it alone steps the LLMEngine. RPC
threads talk to it with commands on its queue, read tokens from one stream per sequence, and
read what it publishes (`snapshot`), never the engine itself.

  submit(seq, blocks, first_token, first_logprobs) -> TokenStream
                                  AddSequence: the sequence joins the batch
  abort(seq_id)                   AbortSequence: the sequence is dropped

Commands are handled in the order they were put, so an abort put after the submit of its
sequence finds it (or finds it finished), whether or not the thread had admitted it yet.

After each admit and each step the thread publishes a new EngineSnapshot, and only then hands
out that admit's or step's tokens and outcomes: whoever reads a token sees a snapshot at least as
new. A stream yields Tokens (everything generated since the reader last looked, so a slow reader
gets several per message, each with its log-probabilities when the sequence asked for them) and
ends with exactly one Finished or EngineFailed; its `on_end` runs on the engine thread just
before that last item is put.

If the engine raises (a CUDA error, a bug), its state is lost: every open stream ends with
EngineFailed at once, and so does every later submit, instead of waiting on a stream that no
step will feed. `failure` then says what happened; the server must be restarted.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.sampling import TokenLogprobs
from engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class EngineFailed:
    message: str


@dataclass(frozen=True)
class Tokens:
    """A stream's new tokens, in order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    """One per token_ids entry, in the same order, when the sequence asked; else empty."""
    finished: Finished | None = None
    """Set when the last of these tokens ended the sequence: the stream ends here, and the
    reader knows which token did it (a stop token's text is no part of the output)."""


_Token = tuple[int, TokenLogprobs | None]


class TokenStream:
    def __init__(self, on_end: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[_Token | Finished | EngineFailed] = queue.SimpleQueue()
        self._on_end = on_end
        self._ended = False

    def put(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self._queue.put((token_id, logprobs))

    def end(self, outcome: Finished | EngineFailed, last: _Token | None = None) -> None:
        """The stream's last item, with `last`, the token that ended it, if one did (one queue
        item: a reader sees both together); later ends are ignored (a command whose admission
        raised is both live and refused). `on_end` runs first, so whoever reads the outcome
        sees what on_end did."""
        if self._ended:
            return
        self._ended = True
        if self._on_end is not None:
            self._on_end()
        self._queue.put(_End(outcome, last))

    def __iter__(self) -> Iterator[Tokens | Finished | EngineFailed]:
        """Batches of tokens as they come, then the end: the last batch carrying its Finished,
        or a Finished alone, or an EngineFailed."""
        while True:
            batch: list[_Token] = []
            item = self._queue.get()
            while True:
                if isinstance(item, _End):
                    batch += [item.last] if item.last is not None else []
                    if isinstance(item.outcome, Finished) and batch:
                        yield _tokens(batch, item.outcome)
                        return
                    if batch:
                        yield _tokens(batch)
                    yield item.outcome
                    return
                batch.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            yield _tokens(batch)


@dataclass(frozen=True)
class _End:
    outcome: Finished | EngineFailed
    last: _Token | None


def _tokens(batch: list[_Token], finished: Finished | None = None) -> Tokens:
    logprobs = [lp for _, lp in batch if lp is not None]
    # A sequence that asks has every token's, its first (the prefill's) included.
    assert not logprobs or len(logprobs) == len(batch)
    return Tokens([token for token, _ in batch], logprobs, finished)


@dataclass(frozen=True)
class AddSequence:
    """Join `seq`, whose prompt KV is in `block_ids`, to the running batch."""

    seq: Sequence
    block_ids: list[int]
    """Owned by the engine from here on: it frees them when the sequence ends."""
    first_token: int
    """The prefill's token: the sequence's first output, the first item of its stream."""
    stream: TokenStream
    first_logprobs: TokenLogprobs | None = None
    """first_token's, as the prefill reported them (when the sequence asks for logprobs)."""


@dataclass(frozen=True)
class AbortSequence:
    """Drop the sequence (its stream ends with ABORT); nothing if it has finished already."""

    seq_id: str


Command = AddSequence | AbortSequence


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as its thread last saw it, after an admit or a step."""

    running: int = 0
    """Sequences in the running batch."""
    waiting: int = 0
    """Sequences admitted and waiting for blocks or a batch slot."""
    outstanding_tokens: int = 0
    """Tokens the live sequences may still generate (max_tokens less those generated)."""


class EngineLoop(EngineThread):
    def __init__(self, engine: LLMEngine) -> None:
        self._live: dict[str, tuple[Sequence, TokenStream]] = {}
        self.snapshot = EngineSnapshot()
        """Replaced, never changed, by the engine thread: other threads read it as it is."""
        super().__init__(engine, server="decode", thread_name="engine-loop")

    def submit(
        self,
        seq: Sequence,
        block_ids: list[int],
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> TokenStream:
        stream = TokenStream(on_end)
        self._put(AddSequence(seq, block_ids, first_token, stream, first_logprobs))
        return stream

    def abort(self, seq_id: str) -> None:
        self._put(AbortSequence(seq_id))

    def _admit(self, command: Command) -> None:
        delivered = []
        match command:
            case AddSequence(seq, block_ids, first_token, stream, first_logprobs):
                self._live[seq.seq_id] = (seq, stream)
                admitted = self.engine.add_prefilled(seq, block_ids, first_token)
                reason = None if admitted else seq.finish_reason  # the first token finished it
                delivered.append(self._delivery(seq.seq_id, first_token, reason, first_logprobs))
            case AbortSequence(seq_id):
                if self.engine.abort(seq_id):
                    delivered.append(self._delivery(seq_id, None, FinishReason.ABORT))
        self._publish(delivered)

    def _step(self) -> None:
        self._publish(
            [
                self._delivery(out.seq_id, out.token_id, out.finish_reason, out.logprobs)
                for out in self.engine.step()
                if out.seq_id in self._live
            ]
        )

    def _fail_live(self, failure: str) -> None:
        self.snapshot = EngineSnapshot()  # the engine's state is lost: nothing runs
        for seq_id in list(self._live):
            self._live.pop(seq_id)[1].end(EngineFailed(failure))

    def _refuse(self, command: Command, failure: str) -> None:
        if isinstance(command, AddSequence):
            command.stream.end(EngineFailed(failure))

    def _delivery(
        self,
        seq_id: str,
        token_id: int | None,
        reason: FinishReason | None,
        logprobs: TokenLogprobs | None = None,
    ) -> _Delivery:
        """A token for the sequence's stream, and its end if `reason` finished it (it leaves)."""
        seq, stream = self._live[seq_id]
        if reason is None:
            return _Delivery(stream, token_id, logprobs)
        del self._live[seq_id]
        finished = Finished(reason, seq.num_prompt_tokens, seq.num_output_tokens)
        return _Delivery(stream, token_id, logprobs, finished)

    def _publish(self, delivered: list[_Delivery]) -> None:
        """A new snapshot, then what the admit or step gave each stream: whoever reads a token
        or an outcome sees a snapshot at least as new as it."""
        scheduler = self.engine.scheduler
        self.snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            outstanding_tokens=sum(
                seq.stop.max_tokens - seq.num_output_tokens for seq, _ in self._live.values()
            ),
        )
        for delivery in delivered:
            token = None if delivery.token_id is None else (delivery.token_id, delivery.logprobs)
            if delivery.finished is not None:
                delivery.stream.end(delivery.finished, token)
            elif token is not None:
                delivery.stream.put(*token)


@dataclass(frozen=True)
class _Delivery:
    """What one admit or step gives one stream, once the snapshot is published."""

    stream: TokenStream
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    finished: Finished | None = None
