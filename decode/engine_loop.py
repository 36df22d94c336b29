"""The decode server's engine thread (engine.engine_thread): it alone steps the LLMEngine. RPC
threads talk to it with commands on its queue, read tokens from one stream per request, and
read what it publishes (`snapshot`), never the engine itself.

  submit(group, choices, block_ids) -> TokenStream
                                  AddChoices: a request's choices (OpenAI's n, one sequence
                                  each, sharing the prompt's KV) join the batch; choices
                                  without a first token prefill their prompt here first
  abort(group, choices)           AbortChoices: those choices (all by default) are dropped

Commands are handled in the order they were put, so an abort put after the submit of its group
finds its sequences (or finds them finished), whether or not the thread had admitted them yet.

After each admit and each step the thread publishes a new EngineSnapshot, and only then hands
out that admit's or step's tokens and outcomes: whoever reads a token sees a snapshot at least as
new. A stream multiplexes its choices: it yields Tokens of one choice at a time (everything that
choice generated since the reader last looked, so a slow reader gets several per message, each
with its log-probabilities when the sequence asked for them), the last of each choice carrying
its Finished, and stops once every choice has finished; or it ends with one EngineFailed. Its
`on_end` runs once, on the engine thread, just before the last choice's end (or the failure) is
put.

If the engine raises (a CUDA error, a bug), its state is lost: every open stream ends with
EngineFailed at once, and so does every later submit, instead of waiting on a stream that no
step will feed. `failure` then says what happened; the server must be restarted.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
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
    spec_decode: tuple[list[int], int] | None = None
    """Speculating: the choice's (acceptance histogram, draft tokens)."""


@dataclass(frozen=True)
class EngineFailed:
    message: str


@dataclass(frozen=True)
class Tokens:
    """A choice's new tokens, in order."""

    index: int
    """The choice: its position in the submitted list."""
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    """One per token_ids entry, in the same order, when the sequence asked; else empty."""
    finished: Finished | None = None
    """Set when the choice has ended: with the token that ended it last, if one did (a stop
    token's text is no part of the output), or with no token at all (an abort)."""


_Token = tuple[int, TokenLogprobs | None]


@dataclass(frozen=True)
class _Put:
    index: int
    token: _Token


@dataclass(frozen=True)
class _End:
    index: int
    finished: Finished
    last: _Token | None


class TokenStream:
    """Written by the engine thread only; read by one reader."""

    def __init__(self, num_choices: int = 1, on_end: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[_Put | _End | EngineFailed] = queue.SimpleQueue()
        self._num_choices = num_choices
        self._open = set(range(num_choices))
        """Choices not ended yet, as the writer sees them."""
        self._on_end = on_end
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
        """Choice 0's prompt entries (SamplingParams.prompt_logprobs), set by the engine thread
        before it puts that choice's first token: a reader that has read it sees them."""

    def put(self, index: int, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self._queue.put(_Put(index, (token_id, logprobs)))

    def end(self, index: int, finished: Finished, last: _Token | None = None) -> None:
        """Choice `index`'s last item, with `last`, the token that ended it, if one did (one
        queue item: a reader sees both together); a later end of it is ignored. The last
        choice's end runs `on_end` first, so whoever reads it sees what on_end did."""
        if index not in self._open:
            return
        self._open.remove(index)
        if not self._open and self._on_end is not None:
            self._on_end()
        self._queue.put(_End(index, finished, last))

    def fail(self, failure: EngineFailed) -> None:
        """Ends every choice at once (after `on_end`); ignored once every choice has ended (a
        command whose admission raised is both live and refused)."""
        if not self._open:
            return
        self._open.clear()
        if self._on_end is not None:
            self._on_end()
        self._queue.put(failure)

    def __iter__(self) -> Iterator[Tokens | EngineFailed]:
        """Batches of one choice's tokens as they come, each choice's last carrying its
        Finished, until every choice has finished; or up to an EngineFailed, which is last."""
        left = self._num_choices
        while left:
            batches: dict[int, list[_Token]] = {}  # choice -> tokens, in order of arrival
            ends: dict[int, Finished] = {}
            failure = None
            for item in self._drain():
                match item:
                    case _Put(index, token):
                        batches.setdefault(index, []).append(token)
                    case _End(index, finished, last):
                        batches.setdefault(index, []).extend([last] if last is not None else [])
                        ends[index] = finished
                    case EngineFailed():
                        failure = item
            for index, batch in batches.items():
                yield _tokens(index, batch, ends.get(index))
            if failure is not None:
                yield failure
                return
            left -= len(ends)

    def _drain(self) -> list[_Put | _End | EngineFailed]:
        """What is queued, waiting for one item if none is."""
        items = [self._queue.get()]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


def _tokens(index: int, batch: list[_Token], finished: Finished | None = None) -> Tokens:
    logprobs = [lp for _, lp in batch if lp is not None]
    # A sequence that asks has every token's, its first (the prefill's) included.
    assert not logprobs or len(logprobs) == len(batch)
    return Tokens(index, [token for token, _ in batch], logprobs, finished)


@dataclass(frozen=True)
class Choice:
    """One choice of a submitted request: a sequence and where it starts."""

    seq: Sequence
    first_token: int | None
    """The prefill's token: the choice's first output, the first token of its stream. None: no
    prefill ran; the engine prefills the prompt and samples the first token itself."""
    first_logprobs: TokenLogprobs | None = None
    """first_token's, as the prefill reported them (when the sequence asks for logprobs)."""
    streamed: bool = False
    """The caller has streamed first_token already (it knew the token does not finish the
    choice): the engine thread does not put it in the stream again."""


@dataclass(frozen=True)
class AddChoices:
    """Join the choices of one prompt, whose KV is in `block_ids`, to the running batch."""

    group: str
    """The caller's name for them, unique among the groups with a live choice."""
    choices: tuple[Choice, ...]
    block_ids: list[int]
    """Owned by the engine from here on (engine.LLMEngine.add_prefilled_choices)."""
    stream: TokenStream


@dataclass(frozen=True)
class AbortChoices:
    """Drop these choices of the group (each ends with ABORT), every one when `indexes` is None.
    Choices out of range or finished already, and groups not live, are passed over."""

    group: str
    indexes: tuple[int, ...] | None = None


Command = AddChoices | AbortChoices


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as its thread last saw it, after an admit or a step."""

    running: int = 0
    """Sequences in the running batch."""
    waiting: int = 0
    """Sequences admitted and waiting for blocks or a batch slot."""
    outstanding_tokens: int = 0
    """Tokens the live sequences may still generate (max_tokens less those generated)."""


@dataclass(frozen=True)
class _LiveChoice:
    seq: Sequence
    group: str
    index: int
    stream: TokenStream


class EngineLoop(EngineThread):
    def __init__(self, engine: LLMEngine) -> None:
        self._live: dict[str, _LiveChoice] = {}
        """seq_id -> its choice, until the choice has ended."""
        self._groups: dict[str, list[str]] = {}
        """group -> the seq_ids of its choices, in order, until every one has ended."""
        self.snapshot = EngineSnapshot()
        """Replaced, never changed, by the engine thread: other threads read it as it is."""
        super().__init__(engine, server="decode", thread_name="engine-loop")

    def submit(
        self,
        group: str,
        choices: Seq[Choice],
        block_ids: list[int],
        on_end: Callable[[], None] | None = None,
    ) -> TokenStream:
        stream = TokenStream(len(choices), on_end)
        self._put(AddChoices(group, tuple(choices), block_ids, stream))
        return stream

    def abort(self, group: str, indexes: Seq[int] | None = None) -> None:
        self._put(AbortChoices(group, None if indexes is None else tuple(indexes)))

    def _admit(self, command: Command) -> None:
        delivered = []
        match command:
            case AddChoices(group, choices, block_ids, stream):
                assert group not in self._groups, group
                self._groups[group] = [choice.seq.seq_id for choice in choices]
                for index, choice in enumerate(choices):
                    self._live[choice.seq.seq_id] = _LiveChoice(choice.seq, group, index, stream)
                if choices[0].first_token is None:  # no token before the engine's first step
                    for choice in choices:
                        self.engine.add_sequence(choice.seq)
                else:
                    delivered += self._add_prefilled(choices, block_ids)
            case AbortChoices(group, indexes):
                picked = self._groups.get(group, [])
                if indexes is not None:
                    picked = [picked[i] for i in dict.fromkeys(indexes) if 0 <= i < len(picked)]
                for seq_id in self.engine.abort_all(picked):
                    delivered.append(self._delivery(seq_id, None, FinishReason.ABORT))
        self._publish(delivered)

    def _add_prefilled(self, choices: Seq[Choice], block_ids: list[int]) -> list[_Delivery]:
        """Choices whose prompt KV is in `block_ids`: each one's first token, which may end it
        (unless the caller streamed it: then only that end, if it came)."""
        admitted = self.engine.add_prefilled_choices(
            [choice.seq for choice in choices], block_ids, [c.first_token for c in choices]
        )
        return [
            self._delivery(
                choice.seq.seq_id,
                None if choice.streamed else choice.first_token,
                None if joined else choice.seq.finish_reason,  # its first token finished it
                None if choice.streamed else choice.first_logprobs,
            )
            for choice, joined in zip(choices, admitted, strict=True)
            if not (joined and choice.streamed)
        ]

    def _step(self) -> None:
        self._publish(
            [
                self._delivery(
                    out.seq_id, out.token_id, out.finish_reason, out.logprobs, out.prompt_logprobs
                )
                for out in self.engine.step()
                if out.seq_id in self._live
            ]
        )

    def _fail_live(self, failure: str) -> None:
        self.snapshot = EngineSnapshot()  # the engine's state is lost: nothing runs
        for live in self._live.values():
            live.stream.fail(EngineFailed(failure))  # once per stream: later ones are ignored
        self._live.clear()
        self._groups.clear()

    def _refuse(self, command: Command, failure: str) -> None:
        if isinstance(command, AddChoices):
            command.stream.fail(EngineFailed(failure))

    def _delivery(
        self,
        seq_id: str,
        token_id: int | None,
        reason: FinishReason | None,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> _Delivery:
        """A token for the choice's stream, and its end if `reason` finished it (it leaves, and
        its group with its last choice)."""
        live = self._live[seq_id]
        if reason is None:
            return _Delivery(live.stream, live.index, token_id, logprobs, None, prompt_logprobs)
        del self._live[seq_id]
        if not any(other in self._live for other in self._groups[live.group]):
            del self._groups[live.group]
        seq = live.seq
        spec = None
        if self.engine.proposer is not None:
            k = self.engine.config.num_speculative_tokens
            spec = (seq.acceptance_histogram or [0] * (k + 1), seq.num_draft_tokens)
        finished = Finished(reason, seq.num_prompt_tokens, seq.num_output_tokens, spec)
        return _Delivery(live.stream, live.index, token_id, logprobs, finished, prompt_logprobs)

    def _publish(self, delivered: list[_Delivery]) -> None:
        """A new snapshot, then what the admit or step gave each stream: whoever reads a token
        or an outcome sees a snapshot at least as new as it."""
        scheduler = self.engine.scheduler
        self.snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            outstanding_tokens=sum(
                live.seq.stop.max_tokens - live.seq.num_output_tokens
                for live in self._live.values()
            ),
        )
        for delivery in delivered:
            if delivery.prompt_logprobs is not None:
                delivery.stream.prompt_logprobs = delivery.prompt_logprobs
            token = None if delivery.token_id is None else (delivery.token_id, delivery.logprobs)
            if delivery.finished is not None:
                delivery.stream.end(delivery.index, delivery.finished, token)
            elif token is not None:
                delivery.stream.put(delivery.index, *token)


@dataclass(frozen=True)
class _Delivery:
    """What one admit or step gives one choice's stream, once the snapshot is published."""

    stream: TokenStream
    index: int
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    finished: Finished | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
