"""Proposers fed the target's hidden states: a model's MTP layers (engine.mtp) and EAGLE-3
heads (engine.eagle). Each layer's `predict(target, ids, positions, previous, kv_cache, meta,
logit_rows)` gives (g, logits) for token j + 1 at position j after `previous`, the target's state
at j (or g of the draft before), over a KV cache of its own whose blocks are the target's, as a
draft model's are (engine/draft_proposer.py).

`HiddenStateProposer` keeps, per sequence, the target's states of the positions its cache lacks
(`Sequence.draft_hidden`, recorded after every target step: the prompt's, then the positions the
target accepted; `prepare`d first: an EAGLE-3 head's `fc`) and `Sequence.num_draft_computed`; a
proposal first feeds those positions (one forward), whose last row gives draft 1, then one row
per further draft. Every forward lays its tokens out a row each, with its own position and its
sequence's block table (AttentionMetadata.new_kv_first), so that steps of up to MAX_GRAPH_ROWS
rows replay CUDA graphs (engine.cuda_graphs, the layer's `predict` captured).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.host_values import to_device
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sequence import Sequence
from engine.speculative import RowIndex, chain_drafts, draft_table, repeat_rows
from engine.step_plan import ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from engine.launched_step import LaunchedStep


class HiddenStateProposer:
    kv_cache: KVCache

    def __init__(
        self,
        layers: list[nn.Module],
        target: CausalLM,
        kv_cache: KVCache,
        max_chunk: int,
        depth: int,
        graphs: list[DecodeGraphs] | None = None,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`max_chunk`: rows of one sequence a catch-up forward feeds at most (the engine's
        max_num_batched_tokens); `depth`: drafts a proposal holds at most (k); `graphs`: one per
        layer (new_kv_first, its `forward` the layer's `predict`), for steps of up to their
        max_batch rows; the rest runs eagerly. `prepare`: the target's recorded rows -> the
        layers' `previous` (None: as they are)."""
        self.layers = layers
        self.depth = depth
        self.prepare = prepare
        self.max_chunk = max_chunk
        self.target = target
        self.kv_cache = kv_cache
        self.graphs = graphs
        self.device = kv_cache.storage.device
        self._aheads: list[DraftsAhead] = []
        """The drafts `draft_ahead` launched, oldest first, until their verification's step is
        recorded (two at most: a step planned ahead is launched before the one before it is
        read)."""
        self._ready: dict[str, tuple[int, int]] = {}
        """seq_id -> (its token count once recorded, its row of _ready_drafts): drafted ahead
        for the next proposal."""
        self._ready_drafts: DraftsAhead | None = None

    def record(self, plan: StepPlan, hidden: torch.Tensor | None, accepted: dict[str, int]) -> None:
        """Keeps the target's states of the positions a finished step settled: every fed one,
        or of a sequence that fed drafts its last token's and the accepted drafts'. Those of a
        sequence the step finished too: a prefill fills the proposer's cache of its prompt
        after its first token (`fill_prompt`)."""
        self._ready = {}
        for i, ahead in enumerate(self._aheads):
            if ahead.step.plan is plan:  # the step's plan as resolved since, if it was shifted
                self._settle_ahead(ahead, accepted)
                del self._aheads[: i + 1]
                break
        if hidden is None:
            return
        row = 0
        for item in plan.scheduled:
            seq, fed = item.seq, item.num_new_tokens
            keep = 1 + accepted[seq.seq_id] if item.draft else fed
            pending = seq.draft_hidden
            have = seq.num_draft_computed + (0 if pending is None else len(pending))
            if have == item.start:
                rows = hidden[row : row + keep]
                # A graph's rows are its buffer's, which the next replay overwrites.
                rows = rows.clone() if self.prepare is None else self.prepare(rows)
                seq.draft_hidden = rows if pending is None else torch.cat([pending, rows])
            row += fed

    def propose(self, seqs: Seq[Sequence], rooms: Seq[int]) -> list[list[int]]:
        """Drafts for the sequences whose hidden states reach their last token (one admitted
        with its prompt's KV gets none at its first step, whose hidden state it waits for), or
        drafted already (`draft_ahead`)."""
        ready, self._ready = self._ready, {}
        drafts = self._propose(seqs, rooms)
        if ready:
            table = self._ready_drafts.read()
            for i, (seq, room) in enumerate(zip(seqs, rooms, strict=True)):
                num_tokens, row = ready.get(seq.seq_id, (None, 0))
                if num_tokens is not None and _drafted_ahead(seq, num_tokens):
                    drafts[i] = [t for t in table[row][:room] if t >= 0]
        return drafts

    def _propose(self, seqs: Seq[Sequence], rooms: Seq[int]) -> list[list[int]]:
        active = [
            (seq, room) for seq, room in zip(seqs, rooms, strict=True) if room > 0 and _covered(seq)
        ]
        if not active:
            return [[] for _ in seqs]
        g, guesses = self._catch_up([seq for seq, _ in active])

        def step(j: int, rows: list[int], index: RowIndex, previous: torch.Tensor):
            # Draft j - 1 at position N - 2 + j, after g of the position before.
            nonlocal g
            riding = [active[i][0] for i in rows]
            positions = [seq.num_tokens - 2 + j for seq in riding]
            tables = [seq.block_ids for seq in riding]
            g_rows, guesses = self._rows(j, previous, positions, tables, g[index])
            g = _updated(g, index, g_rows)
            return guesses

        return chain_drafts(seqs, active, guesses, step)

    def draft_ahead(self, step: LaunchedStep) -> None:
        """Right after a verification is launched, before the host reads it: drafts of the next
        step of its sequences that fed drafts, from the device's results. Each one's k + 1 fed
        rows are fed again (the token after each, its target state), the row of its last
        accepted token gives draft 1, and the further drafts' rows sit `accepted` positions past
        where the host places them (DecodeGraphs.run's offsets). The rows past the accepted ones
        write KV at positions that every later forward writes again before reading them.
        `propose` returns these drafts when the sequence is where the step leaves it: the device
        has kept working while the host read the results and planned the step. A sequence with
        other states pending is left to `record`, as are those without drafts.

        A shifted step (StepPlan.shifted: planned before the one before it was read, each of
        its sequences drafted ahead there) sits `step.shift` further on the device: its rows
        and drafts are moved by that too."""
        verified = step.verified
        if verified is None or step.hidden is None:
            return
        chosen = drafting_rows(step.plan)
        if not chosen:
            return
        items = [item for item, _, _, _ in chosen]
        positions, tables, hidden_rows, verify_rows, firsts, active = [], [], [], [], [], []
        furthest = self.depth if step.plan.shifted else 0  # the most step.shift can add
        for item, hidden_row, verify_row, _ in chosen:
            seq, fed = item.seq, item.num_new_tokens
            firsts.append(len(positions))
            positions.extend(range(item.start, item.start + fed))
            tables.extend([seq.block_ids] * fed)
            hidden_rows.extend(range(hidden_row, hidden_row + fed))
            verify_rows.extend(range(verify_row, verify_row + fed))
            # Draft j sits at start + accepted + j: within the sequence's blocks and length.
            limit = min(len(seq.block_ids) * self.kv_cache.block_size, seq.max_model_len)
            room = limit - item.start - furthest - len(item.draft)
            active.append((seq, max(1, min(self.depth, room))))
        ids, hidden = verified.row_tokens, step.hidden
        if len(verify_rows) < len(ids) or len(hidden_rows) < len(hidden):  # some not drafting
            ids = ids[to_device(verify_rows, self.device)]
            hidden = hidden[to_device(hidden_rows, self.device)]
        accepted, shift = verified.accepted, step.shift
        if len(chosen) < len(accepted):  # some sampling sequences not drafting
            sampling = to_device([i for _, _, _, i in chosen], self.device)
            accepted = accepted[sampling]
            shift = None if shift is None else shift[sampling]
        row_shift = None
        if shift is not None:
            row_shift = repeat_rows(shift, [item.num_new_tokens for item in items])
        previous = hidden if self.prepare is None else self.prepare(hidden)
        g, greedy = self._rows(0, ids, positions, tables, previous, offsets=row_shift)
        last = to_device(firsts, self.device) + accepted
        g = g[last]
        if shift is not None:
            accepted = accepted + shift  # from here on, each sequence's whole offset

        def chain(j: int, rows: list[int], index: RowIndex, before: torch.Tensor):
            nonlocal g
            riding = [items[i] for i in rows]
            at = [item.start + j for item in riding]
            tables = [i.seq.block_ids for i in riding]
            g_rows, guesses = self._rows(j, before, at, tables, g[index], offsets=accepted[index])
            g = _updated(g, index, g_rows)
            return guesses

        table = draft_table(active, greedy[last], chain)
        self._aheads = [*self._aheads[-1:], DraftsAhead(step, active, table)]

    def ahead_of(self, step: LaunchedStep) -> DraftsAhead | None:
        """The drafts made ahead after `step`, when every sequence of it has some."""
        for ahead in self._aheads:
            if ahead.step is step:
                seq_ids = {item.seq.seq_id for item in step.plan.scheduled}
                return ahead if seq_ids <= set(ahead.rows) else None
        return None

    def _settle_ahead(self, ahead: DraftsAhead, accepted: dict[str, int]) -> None:
        """The step drafted ahead is read: its drafting sequences' caches hold the positions up
        to their last accepted token (so `record` passes them over)."""
        for item in ahead.step.plan.scheduled:
            seq = item.seq
            row = ahead.rows.get(seq.seq_id)
            if row is not None:
                # A resolved item may have had no draft left to verify (Scheduler.resolve).
                seq.num_draft_computed = item.start + 1 + accepted.get(seq.seq_id, 0)
                self._ready[seq.seq_id] = (seq.num_tokens, row)
        self._ready_drafts = ahead

    def fill_prompt(self, seqs: Seq[Sequence]) -> None:
        """The proposer's cache of positions 0 .. N - 2 of each sequence of N tokens (its prompt and
        first token, on a prefill): the catch-up a first proposal would run."""
        missing = [seq.seq_id for seq in seqs if not _covered(seq)]
        assert not missing, f"no hidden states kept for {missing}"
        if seqs:
            self._catch_up(list(seqs), logits=False)

    def _catch_up(
        self, seqs: list[Sequence], logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds each sequence's pending positions (j with token j + 1, h_j), a row each, at
        most max_chunk rows of a sequence a forward (a whole prompt's would not fit): g and the
        greedy draft 1 after each one's last (`logits`: else no draft)."""
        while behind := [seq for seq in seqs if len(seq.draft_hidden) > self.max_chunk]:
            self._feed(behind, self.max_chunk, logits=False)
        return self._feed(seqs, None, logits)

    def _feed(
        self, seqs: list[Sequence], limit: int | None, logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `limit` (None: all) pending positions of each sequence."""
        counts = [len(seq.draft_hidden) if limit is None else limit for seq in seqs]
        ids, positions, tables, last = [], [], [], []
        for seq, count in zip(seqs, counts, strict=True):
            start = seq.num_draft_computed
            ids.extend(seq.token_ids[start + 1 : start + count + 1])
            positions.extend(range(start, start + count))
            tables.extend([seq.block_ids] * count)
            last.append(len(ids) - 1)
        previous = torch.cat([seq.draft_hidden[:n] for seq, n in zip(seqs, counts, strict=True)])
        last_rows = to_device(last if logits else [], self.device, torch.long)
        g, greedy = self._rows(0, ids, positions, tables, previous, last_rows)
        for seq, count in zip(seqs, counts, strict=True):
            seq.num_draft_computed += count
            seq.draft_hidden = seq.draft_hidden[count:] if count < len(seq.draft_hidden) else None
        return g[last_rows], greedy

    def _rows(
        self,
        depth: int,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
        previous: torch.Tensor,
        greedy_rows: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g of each row, greedy token of each of greedy_rows, all rows if None): token
        ids[i] at positions[i] (+ offsets[i], on the device) of the sequence with block table
        tables[i], after hidden state previous[i]; every row's KV written before any row
        attends. In a graph when one holds the rows."""
        layer = depth % len(self.layers)
        fed = ids if isinstance(ids, torch.Tensor) else None
        graphs = None if self.graphs is None else self.graphs[layer]
        if graphs is not None and len(positions) <= graphs.max_batch:
            host_ids = None if fed is not None else ids
            step = graphs.run(
                host_ids, positions, tables, fed_ids=fed, previous=previous, offsets=offsets
            )
            greedy = step.greedy if greedy_rows is None else step.greedy[greedy_rows]
            return step.hidden, greedy
        if offsets is not None:  # eagerly, the host needs them (on a GPU: a wait)
            positions = [p + o for p, o in zip(positions, offsets.tolist(), strict=True)]
        lens = [p + 1 for p in positions]
        meta = AttentionMetadata.build(
            [1] * len(positions), lens, tables, self.kv_cache.block_size, self.device
        )
        g, logits = self.layers[layer].predict(
            self.target,
            fed if fed is not None else to_device(ids, self.device),
            to_device(positions, self.device),
            previous,
            self.kv_cache.kv_caches[layer],
            dataclasses.replace(meta, new_kv_first=True),
            greedy_rows,
        )
        return g, logits.argmax(dim=-1)


class DraftsAhead:
    """Drafts launched by `draft_ahead` after `step`, a row each for the sequences of `active`
    (sequence, depth), and their copy to the host."""

    def __init__(
        self, step: LaunchedStep, active: list[tuple[Sequence, int]], table: torch.Tensor
    ) -> None:
        self.step = step
        self.table = table
        """[len(active), max depth] on the device, -1 past a row's depth."""
        self.rows = {seq.seq_id: row for row, (seq, _) in enumerate(active)}
        self.depths = {seq.seq_id: depth for seq, depth in active}
        self._host, self._copied = table, None
        if table.is_cuda:
            self._host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            self._host.copy_(table, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def read(self) -> list[list[int]]:
        """The rows (-1 past a sequence's drafts); waits for the device."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()

    def drafts(self) -> dict[str, list[int]]:
        """seq_id -> its drafts; waits for the device."""
        table = self.read()
        return {s: table[row][: self.depths[s]] for s, row in self.rows.items()}


def drafting_rows(plan: StepPlan) -> list[tuple[ScheduledSeq, int, int, int]]:
    """(item, its first fed row, its first verified row, its index among the sampling ones) of
    each item of plan that fed drafts and whose proposer cache is complete up to its start
    (a shifted plan's: each of its sequences was drafted ahead, so its cache will be)."""
    chosen, hidden_row, verify_row, sampling = [], 0, 0, 0
    for item in plan.scheduled:
        seq = item.seq
        complete = seq.draft_hidden is None and seq.num_draft_computed == item.start
        if item.draft and (plan.shifted or complete):
            chosen.append((item, hidden_row, verify_row, sampling))
        hidden_row += item.num_new_tokens
        if item.samples:  # a verified row per fed draft, and one for its last token
            verify_row += 1 + len(item.draft)
            sampling += 1
    return chosen


def _updated(g: torch.Tensor, index: RowIndex, g_rows: torch.Tensor) -> torch.Tensor:
    """g with its `index` rows replaced by g_rows, the states the next draft's forward reads.
    g_rows may be a graph's buffer, which the next replay overwrites: that replay copies its
    inputs (these rows) before it runs, so all rows replaced may stay in the buffer; a part
    goes into a copy of g."""
    if isinstance(index, slice):
        return g_rows
    g = g.clone()
    g[index] = g_rows
    return g


def _drafted_ahead(seq: Sequence, num_tokens: int) -> bool:
    """Whether seq is as the step drafted ahead left it: nothing appended, preempted or
    recorded since."""
    return (
        seq.num_tokens == num_tokens
        and seq.num_draft_computed == num_tokens - 1
        and seq.draft_hidden is None
    )


def _covered(seq: Sequence) -> bool:
    """Whether the hidden states kept for seq reach its last token's position - 1. A sequence
    admitted with its prompt's proposer KV (num_draft_computed = its prompt length) is, after its
    first step here."""
    pending = 0 if seq.draft_hidden is None else len(seq.draft_hidden)
    return seq.num_draft_computed + pending == seq.num_tokens - 1 and pending > 0
