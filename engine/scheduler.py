"""Continuous batching: which sequences run in the next forward, and with how many tokens.

Each step is planned in this order, under a token budget (max_num_batched_tokens):
  1. running sequences, oldest first: decodes take 1 token (and, speculating, room for up to
     num_speculative_tokens drafts: engine/speculative.py), a prompt being prefilled in chunks
     takes what the budget leaves; when a running sequence needs a block and none is free, the
     newest running sequence is preempted (blocks freed, KV recomputed later from its tokens);
  2. waiting sequences, oldest first, while the budget, max_num_seqs and free blocks allow.
     A waiting sequence may already hold KV (admitted prefilled, see `add_prefilled`), or hold
     none and have output tokens to feed with its prompt (preempted, or admitted prefilled
     without its prompt's KV).
A plan counts its tokens as computed when it is made (the forward will write their KV); after the
forward, `update` feeds back the sampled tokens and frees finished sequences' blocks.

`schedule_ahead` plans the decode step after a decode step whose tokens are not known yet (async
scheduling: the engine launches it before it reads them). A sequence that finishes on one of
those tokens (or is aborted) keeps its blocks until the last step planned ahead with it, which
still writes its KV, has been updated; the steps planned after leave it out. After a step that
verifies drafts, the next one is planned so too, from drafts made on the device, its positions
moved there by what that step accepts (`StepPlan.shifted`, made true by `resolve`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, replace

from engine.kv_cache import BlockPool
from engine.prefix_cache import PrefixCache
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_plan import ScheduledSeq, StepPlan


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    """Tokens per KV block."""
    max_num_seqs: int = 256
    """Sequences in one forward at most."""
    max_num_batched_tokens: int = 2048
    """Tokens in one forward at most; longer prompts are prefilled in chunks of what is left."""
    num_speculative_tokens: int = 0
    """Draft tokens a decoding sequence may feed after its last one (speculative decoding):
    its blocks and the step's budget make room for them (engine/speculative.py)."""
    draft_lookahead: int = 0
    """Positions past a step's drafts that its blocks also hold: a proposer drafting the next
    step before the host reads this one's writes KV up to there (engine/hidden_proposer.py)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} is below max_num_seqs "
                f"({self.max_num_seqs}); a full decode batch would not fit"
            )


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, pool: BlockPool, prefix_cache: PrefixCache | None = None
    ) -> None:
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache
        """Prefix caching: admitted sequences start with the cached blocks of their tokens."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._ahead: list[tuple[StepPlan, list[int]]] = []
        """Steps planned ahead and not yet updated, oldest first (two at most: the one the
        engine reads, and the one launched after it), each with the blocks of finished
        sequences it still writes to (freed when it is updated)."""

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence; its whole prompt will be prefilled here."""
        assert seq.status is SequenceStatus.WAITING and not seq.block_ids
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, block_ids: list[int], first_token: int) -> bool:
        """Queues a sequence whose prompt KV is already in `block_ids` (one reference to each
        is the sequence's from now on, dropped when it is preempted or finishes) and whose first
        token was sampled elsewhere. Empty `block_ids`: the KV is not here, and the prompt is
        recomputed with the first token, as after a preemption. Returns False when that token
        already finishes it (the blocks are then freed)."""
        assert seq.status is SequenceStatus.WAITING and seq.num_output_tokens == 0
        assert not block_ids or len(block_ids) * self.config.block_size >= seq.num_prompt_tokens
        seq.block_ids = list(block_ids)
        seq.num_computed = seq.num_prompt_tokens if block_ids else 0
        reason = seq.append(first_token)
        if reason is not None:
            self._finish(seq, reason)
            return False
        self.waiting.append(seq)
        return True

    def abort(self, seq_ids: Collection[str]) -> list[Sequence]:
        """Finishes the waiting or running sequences among `seq_ids` (ABORT) and returns them:
        one pass over each queue however many ids come (a request's thousands of choices; a
        search and a removal per id took minutes for 100k, with the engine stalled)."""
        wanted = set(seq_ids)
        aborted = [seq for seq in (*self.waiting, *self.running) if seq.seq_id in wanted]
        if aborted:
            kept = [seq for seq in self.waiting if seq.seq_id not in wanted]
            self.waiting.clear()
            self.waiting.extend(kept)
            self.running[:] = [seq for seq in self.running if seq.seq_id not in wanted]
            for seq in aborted:
                self._finish(seq, FinishReason.ABORT)
        return aborted

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> StepPlan | None:
        """Plans the next forward; None when there is nothing to run."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            room = self._draft_room(seq, budget)
            while not self._grow(seq, self._step_end(seq, n, room)):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(_scheduled(seq, n, room))
                budget -= n + room
                i += 1
        # After a preemption the pool is exhausted: admitting more would only thrash.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            cached = self._take_cached(seq)
            n = min(seq.num_uncomputed, budget)
            room = self._draft_room(seq, budget)
            if not self._grow(seq, self._step_end(seq, n, room)):
                if cached is not None:  # back to the pool, named: found again next time
                    self._drop_blocks(seq)
                break
            if cached is not None:
                self.prefix_cache.count(seq, cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(_scheduled(seq, n, room))
            budget -= n + room
        if not scheduled:
            return None
        for item in scheduled:
            item.seq.num_computed += item.num_new_tokens
        return StepPlan(tuple(scheduled), tuple(preempted))

    def schedule_ahead(
        self, plan: StepPlan, drafts: dict[str, int] | None = None
    ) -> StepPlan | None:
        """The decode step after `plan`, a decode step whose sampled tokens are not known yet:
        every sequence of it feeds the token it samples there, except those that have finished
        since it was planned (their tokens there are thrown away) and those that stop on their
        length limits with that token (they finish when `plan` is updated). None when that step
        cannot be planned without the tokens: something waits to be admitted, one samples with
        penalties (they count the tokens generated so far, that one included) or under a
        grammar (its mask follows from that token), none goes on, or a block is needed and
        none is free (a normal `schedule` preempts). Speculating, a sequence that could draft
        is not planned ahead without its drafts; with `drafts` (seq_id -> how many were made
        on the device for each sequence of a `plan` that fed drafts) see `_verify_ahead`."""
        live = [item.seq for item in plan.scheduled if not item.seq.finished]
        if (
            self.waiting
            or not all(item.samples for item in plan.scheduled)
            or live != self.running
            or any(not seq.speculates for seq in live)
        ):
            return None
        if drafts is not None:
            return self._verify_ahead(plan, drafts)
        if not all(item.num_new_tokens == 1 for item in plan.scheduled) or (
            self.config.num_speculative_tokens and live
        ):
            return None
        # After the pending token: generated = num_output_tokens + 1, and likewise length.
        continuing = [
            seq
            for seq in live
            if seq.num_output_tokens + 1 < seq.stop.max_tokens
            and seq.num_tokens + 1 < seq.max_model_len
        ]
        if not continuing or not all(self._grow(s, s.num_computed + 1) for s in continuing):
            return None
        scheduled = tuple(ScheduledSeq(seq, seq.num_computed, 1, True) for seq in continuing)
        for seq in continuing:
            seq.num_computed += 1
        ahead = StepPlan(scheduled, ())
        self._ahead.append((ahead, []))
        return ahead

    def _verify_ahead(self, plan: StepPlan, drafts: dict[str, int]) -> StepPlan | None:
        """The verification after `plan`, whose accepted counts are not known: each sequence
        feeds its token and drafts[seq_id] drafts from where it would start if none of its
        drafts in `plan` were accepted (StepPlan.shifted). Its blocks hold the furthest that
        can be (every draft accepted, then the proposer's lookahead). None unless every
        sequence fed drafts and would have room for one of these however many it keeps, and
        the step fits the token budget. Each feeds as many as it has room for if it keeps
        none (`draft_room`); the device verifies those the kept ones leave room for."""
        k = self.config.num_speculative_tokens
        if any(not item.draft or item.seq.seq_id not in drafts for item in plan.scheduled):
            return None
        live = [item for item in plan.scheduled if not item.seq.finished]
        sizes, rooms = [], []
        for item in live:
            seq, most = item.seq, 1 + len(item.draft)  # tokens plan may add
            model_room = seq.max_model_len - seq.num_tokens
            # Drafts after plan's token if it keeps none of its drafts (_draft_room then).
            rooms.append(min(model_room, seq.stop.max_tokens - seq.num_output_tokens) - 2)
            # Their positions stay within max_model_len whatever it keeps.
            sizes.append(min(drafts[seq.seq_id], k, rooms[-1], model_room - most - 1))
            if sizes[-1] < 1:
                return None
        if not live or sum(1 + n for n in sizes) > self.config.max_num_batched_tokens:
            return None
        lookahead = self.config.draft_lookahead
        for item, n in zip(live, sizes, strict=True):
            end = item.seq.num_computed + k + 1 + n + lookahead
            if not self._grow(item.seq, min(end, item.seq.max_model_len)):
                return None
        scheduled = tuple(
            ScheduledSeq(i.seq, i.seq.num_computed, 1 + n, True, room, (-1,) * n)
            for i, n, room in zip(live, sizes, rooms, strict=True)
        )
        for item in live:
            item.seq.num_computed += 1
        ahead = StepPlan(scheduled, (), shifted=True)
        self._ahead.append((ahead, []))
        return ahead

    def resolve(
        self, plan: StepPlan, accepted: dict[str, int], drafts: dict[str, list[int]]
    ) -> StepPlan:
        """A shifted plan once the step before it is updated: each item moved by the drafts
        its sequence kept there (`accepted`), with the drafts it feeds (`drafts`, as made on
        the device) that are verified: those its room left (fewer than its rows feed when it
        kept more than none). The plan returned replaces `plan` from then on."""
        items = []
        for item in plan.scheduled:
            kept = accepted[item.seq.seq_id]
            verified = max(0, min(len(item.draft), item.draft_room - kept))
            draft = tuple(drafts[item.seq.seq_id][:verified])
            items.append(replace(item, start=item.start + kept, draft=draft))
        items = tuple(items)
        resolved = StepPlan(items, plan.preempted)
        for i, (ahead, held) in enumerate(self._ahead):
            if ahead is plan:
                self._ahead[i] = (resolved, held)
        return resolved

    @property
    def ahead_is_idle(self) -> bool:
        """Whether the last step planned ahead is pending and every sequence in it has finished."""
        return bool(self._ahead) and all(i.seq.finished for i in self._ahead[-1][0].scheduled)

    def update(
        self,
        plan: StepPlan,
        sampled: dict[str, int],
        accepted: dict[str, int] | None = None,
    ) -> list[Sequence]:
        """Records a finished forward: `sampled` maps seq_id to the token sampled for every
        scheduled sequence that samples (sequences that finished since the plan was made are
        passed over); `accepted`, for those that fed drafts, how many of them the target kept
        (they come before the sampled token; their KV stays, the rest is never read). Returns
        the sequences that finished."""
        finished = []
        for item in plan.scheduled:
            seq = item.seq
            if self.prefix_cache is not None and not seq.finished:
                self.prefix_cache.record(seq)  # the forward wrote its blocks' KV
            if not item.samples or seq.finished:
                continue
            kept = accepted[seq.seq_id] if item.draft else 0
            for token in (*item.draft[:kept], sampled[seq.seq_id]):
                reason = seq.append(token)
                if reason is not None:
                    break
            seq.num_computed += kept
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        for i, (ahead, held) in enumerate(self._ahead):
            if ahead is plan:
                del self._ahead[i]
                self.pool.free(held)
                break
        return finished

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """Draft tokens seq may feed after its last token this step: none unless it decodes
        (one token left to feed) and speculates; never past its length limits or the budget."""
        k = self.config.num_speculative_tokens
        if not k or seq.num_uncomputed != 1 or not seq.speculates:
            return 0
        # Accepted drafts and the target's token are all appended: stay within both limits.
        limit = min(seq.max_model_len - seq.num_tokens, seq.stop.max_tokens - seq.num_output_tokens)
        return max(0, min(k, limit - 1, budget - 1))

    def _step_end(self, seq: Sequence, n: int, room: int) -> int:
        """Tokens seq's blocks hold for a step that feeds n tokens and up to `room` drafts."""
        end = seq.num_computed + n + room
        if room:
            end = min(end + self.config.draft_lookahead, seq.max_model_len)
        return end

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes seq's blocks hold num_tokens tokens; False if the pool cannot."""
        need = -(-num_tokens // self.config.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        ids = self.pool.allocate(need)
        if ids is None:
            return False
        seq.block_ids.extend(ids)
        return True

    def _take_cached(self, seq: Sequence) -> int | None:
        """Prefix caching: a sequence without KV takes the cached blocks of its leading
        tokens; how many tokens they hold (None: not looked up). Not one that has prompt
        log-probabilities to compute: those need its positions' logits."""
        if self.prefix_cache is None or seq.block_ids or seq.lacks_prompt_logprobs:
            return None
        return self.prefix_cache.take(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        """Frees seq's blocks: its KV is to be computed again (found cached, where it still is)."""
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_named = 0
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._drop_blocks(seq)
        seq.num_draft_computed = 0
        seq.draft_hidden = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.block_ids:
            # The last pending step planned ahead with it still writes its KV.
            held = next(
                (h for p, h in reversed(self._ahead) if any(i.seq is seq for i in p.scheduled)),
                None,
            )
            if held is not None:
                held.extend(seq.block_ids)
            else:
                self.pool.free(seq.block_ids)
            seq.block_ids = []
        seq.finish(reason)


def _scheduled(seq: Sequence, n: int, room: int = 0) -> ScheduledSeq:
    return ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens, room)
