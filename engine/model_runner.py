"""Runs one StepPlan: packs the scheduled tokens, runs the model, samples the next tokens.

Decode-only steps on CUDA replay a captured graph (engine/cuda_graphs.py); everything else
(prefill chunks, mixed batches, CPU, a step with prompt log-probabilities to compute) runs the
model eagerly. Rows of constrained sequences (structured output) have their grammar's mask
applied to the logits, after the graph, before sampling.

`launch` returns as soon as the work is queued on the device (engine/launched_step.py). A step
planned ahead (engine.scheduler.schedule_ahead) feeds the tokens of the step before it, still on
the device, as its input ids; a verification planned ahead (StepPlan.shifted) feeds them with
the drafts a proposer made on the device after it (engine/hidden_proposer.py), at positions the
device moves by the drafts that step accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.cuda_graphs import DecodeGraphs, GraphStep
from engine.grammar import apply_grammars
from engine.host_values import to_device
from engine.kv_cache import KVCache
from engine.launched_step import LaunchedStep, Verified
from engine.model import CausalLM
from engine.prompt_logprobs import compute_prompt_logprobs, prompt_spans
from engine.sampling import Sampler, SamplingRow, compute_logprobs
from engine.spec_acceptance import AcceptanceCurve
from engine.spec_verify import verify
from engine.speculative import RowIndex, repeat_rows, row_index
from engine.step_executor import StepExecutor
from engine.step_plan import ScheduledSeq, StepPlan

if TYPE_CHECKING:
    from engine.hidden_proposer import DraftsAhead


class FedAhead(NamedTuple):
    """A shifted verification's inputs on the device (ModelRunner._fed_ahead)."""

    ids: torch.Tensor
    """[fed rows]: each sequence's token, then its drafts."""
    row_shift: torch.Tensor
    """[fed rows]: each row's sequence's shift."""
    shift: torch.Tensor
    """[sequences]: the drafts the step before kept of each, its positions' offset."""
    padded: torch.Tensor
    """[sequences, width]: the drafts verified, -1 past each one's."""
    counts: torch.Tensor
    """[sequences]: how many of each one's drafts are verified."""


class ModelRunner:
    def __init__(
        self,
        executor: StepExecutor,
        sampler: Sampler,
        max_num_seqs: int,
        acceptance: AcceptanceCurve | None = None,
    ) -> None:
        self.executor = executor
        """Runs the step's device work (every tensor-parallel rank's, when it is rank 0's): its
        model, cache and graphs are the runner's."""
        self.acceptance = acceptance
        """Benchmarks: drafts are accepted as this curve draws, not by comparison."""
        self.sampler = sampler
        self.device = executor.device
        self._host_tokens: list[torch.Tensor] = []
        if self.device.type == "cuda":
            # Two, used in turn: a step's tokens must not land over those of the step before
            # it while the host has yet to read them.
            self._host_tokens = [
                torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)
            ]
        self._launches = 0

    @property
    def model(self) -> CausalLM:
        return self.executor.model

    @property
    def kv_cache(self) -> KVCache:
        return self.executor.kv_cache

    @property
    def graphs(self) -> DecodeGraphs | None:
        """Decode steps, a row per sequence."""
        return self.executor.graphs

    @property
    def verify_graphs(self) -> DecodeGraphs | None:
        """Decode steps that feed drafts, up to its max_batch rows (a row per fed token)."""
        return self.executor.verify_graphs

    def launch(
        self,
        plan: StepPlan,
        feed: LaunchedStep | None = None,
        eager: bool = False,
        drafts: DraftsAhead | None = None,
    ) -> LaunchedStep:
        """Queues one forward over the plan and the sampling of every sequence that samples.
        `feed`: the step before a step planned ahead, whose tokens are this one's input ids.
        `drafts`: a shifted plan's (StepPlan.shifted), made on the device after `feed`.
        `eager`: no graph replay, even for a decode-only plan (a prompt's last one-token chunk
        whose layers the prefill sends as they are written)."""
        sampling = [item for item in plan.scheduled if item.samples]
        spans = prompt_spans(plan)
        eager = eager or bool(spans)  # their logits are of rows no graph computes
        prompt = {}
        ahead = None
        if plan.shifted:
            assert feed is not None and drafts is not None
            ahead = self._fed_ahead(plan, feed, drafts)
            fed = ahead.ids
        else:
            fed = None if feed is None else self._fed_ids(plan, feed)
        greedy = None
        if not eager and self.graphs is not None and plan.is_decode_only:
            logits, greedy, hidden = self._decode_with_graph(plan, fed)
            if len(sampling) < len(plan.scheduled):  # a one-token prompt chunk rode along
                sampling_rows = to_device(
                    [i for i, item in enumerate(plan.scheduled) if item.samples], self.device
                )
                logits, greedy = logits[sampling_rows], greedy[sampling_rows]
        elif not eager and self._verifies_in_graph(plan):
            logits, greedy, hidden = self._verify_with_graph(plan, ahead)
        else:
            # A shifted plan's positions, here on the host (on a GPU: a wait for the step before).
            shifts = None if ahead is None else ahead.shift.tolist()
            hidden, sample_rows = self._forward_eager(plan, fed, shifts)
            hidden = self.model.proposer_hidden(hidden)  # the graphs' hidden is that already
            prompt = compute_prompt_logprobs(spans, self.executor.logits)
            if not sampling:  # a prompt chunk: its hidden states only
                step = LaunchedStep(plan, [], None)
                step.hidden, step.prompt_logprobs = hidden, prompt
                return step
            logits = self.executor.logits(sample_rows)
        rows = [item.seq.sampling_row() for item in sampling]
        if any(item.draft for item in sampling):
            step = self._verify(plan, sampling, logits, greedy, rows, ahead)
        else:
            step = self._sample(plan, sampling, logits, greedy, rows, feed)
        step.hidden = hidden
        step.prompt_logprobs = prompt
        if ahead is not None:
            step.shift, step.fed_drafts = ahead.shift, drafts
        return step

    def _sample(
        self,
        plan: StepPlan,
        sampling: list[ScheduledSeq],
        logits: torch.Tensor,
        greedy: torch.Tensor | None,
        rows: list[SamplingRow],
        feed: LaunchedStep | None,
    ) -> LaunchedStep:
        """The step's tokens (one a sampling sequence), and log-probabilities where asked."""
        if any(item.seq.grammar is not None for item in sampling):  # on the host: no sync
            # A mask follows from the token before it: no step planned ahead has one.
            assert feed is None, "a constrained sequence in a step planned ahead"
            # In place, before sampling and before the logprobs (vLLM's raw logprobs are taken
            # after its grammar mask too); the graph's argmax saw the logits unmasked.
            apply_grammars(logits, [item.seq.grammar for item in sampling])
        if greedy is not None and _argmax_decides(sampling, rows):
            tokens = greedy  # the graph's own argmax: no sampler to launch
        else:
            tokens = self.sampler(logits, rows)
        # From the logits before the sampler's penalties (which leave its input as it is), after
        # any grammar mask.
        logprobs = compute_logprobs(logits, tokens, rows)
        host = self._next_host(len(sampling))
        seq_ids = [item.seq.seq_id for item in sampling]
        return LaunchedStep(plan, seq_ids, tokens, host, logprobs)

    def _verify(
        self,
        plan: StepPlan,
        sampling: list[ScheduledSeq],
        logits: torch.Tensor,
        greedy: torch.Tensor | None,
        rows: list[SamplingRow],
        fed: FedAhead | None = None,
    ) -> LaunchedStep:
        """The step's tokens when some sequence fed drafts: logits has one row per fed token
        of those, one per sequence otherwise (engine/spec_verify.py); greedy, where not None,
        each row's argmax (the graph's). `fed`: a shifted plan's drafts, on the device."""
        drafts = [item.draft for item in sampling]
        simulated = None
        if self.acceptance is not None:
            simulated = []
            for item in sampling:
                seq, n = item.seq, len(item.draft)
                simulated.append(self.acceptance.draw(n, seq.seq_id, seq.num_verifications))
                seq.num_verifications += n > 0
        on_device = (None, None) if fed is None else (fed.padded, fed.counts)
        if not _argmax_decides(sampling, rows):
            greedy = None
        tokens, accepted, row_tokens = verify(
            logits, drafts, rows, self.sampler, simulated, *on_device, greedy=greedy
        )
        # Each row's raw log-probabilities, of the token it gave (the rows past a sequence's
        # accepted ones are computed and dropped).
        per_seq = [len(d) + 1 for d in drafts]
        expanded = [row for row, count in zip(rows, per_seq, strict=True) for _ in range(count)]
        logprobs = compute_logprobs(logits, row_tokens, expanded)
        host = self._next_host(len(sampling))
        seq_ids = [item.seq.seq_id for item in sampling]
        step = LaunchedStep(plan, seq_ids, tokens, host, logprobs, accepted, per_seq)
        step.verified = Verified(row_tokens, accepted)
        return step

    def _verifies_in_graph(self, plan: StepPlan) -> bool:
        """A decode step that feeds drafts, whose rows fit the verification graphs."""
        graphs = self.verify_graphs
        return (
            graphs is not None
            and all(item.num_new_tokens == 1 + len(item.draft) for item in plan.scheduled)
            and plan.num_tokens <= graphs.max_batch
        )

    def _verify_with_graph(self, plan: StepPlan, fed: FedAhead | None = None) -> GraphStep:
        """Logits and greedy tokens of the sampling sequences' rows (each fed token of
        theirs), and every row's hidden state: a graph replay with a row per fed token, at its
        position, with its sequence's block table. `fed`: a shifted plan's ids and offsets, on
        the device."""
        ids, positions, tables, sample_rows, row_in_seq = [], [], [], [], []
        per_seq = self.verify_graphs.max_rows_per_seq
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            if item.samples:
                sample_rows.extend(range(len(positions), len(positions) + n))
            if fed is None:
                ids.append(seq.token_ids[item.start])
                ids.extend(item.draft)
            positions.extend(range(item.start, item.start + n))
            tables.extend([seq.block_ids] * n)
            assert n <= per_seq, "a verification graph's sequence has k + 1 rows at most"
            row_in_seq.extend(range(n))
        if fed is None:
            logits, greedy, hidden = self.executor.replay(True, ids, positions, tables, row_in_seq)
        else:
            logits, greedy, hidden = self.executor.replay(
                True, None, positions, tables, row_in_seq, fed_ids=fed.ids, offsets=fed.row_shift
            )
        if len(sample_rows) < len(positions):  # a one-token prompt chunk rode along
            index = to_device(sample_rows, self.device)
            logits, greedy = logits[index], greedy[index]
        return GraphStep(logits, greedy, hidden)

    def _next_host(self, n: int) -> torch.Tensor | None:
        if not self._host_tokens:
            return None
        self._launches += 1
        return self._host_tokens[self._launches % 2][:n]

    def _fed_ids(self, plan: StepPlan, feed: LaunchedStep) -> torch.Tensor:
        """The input ids of a step planned ahead: the tokens `feed` samples for its sequences
        (one of `feed` that has finished, or stops on its length there, has no row in `plan`)."""
        return feed.tokens[self._feed_rows(plan, feed)]

    def _feed_rows(self, plan: StepPlan, feed: LaunchedStep) -> RowIndex:
        """Each scheduled sequence's row of `feed`'s tokens: a view of all of them where the
        plan keeps `feed`'s sequences in their order (the usual case)."""
        row = {seq_id: i for i, seq_id in enumerate(feed.seq_ids)}
        rows = [row[item.seq.seq_id] for item in plan.scheduled]
        return row_index(rows, len(feed.seq_ids), self.device)

    def _fed_ahead(self, plan: StepPlan, feed: LaunchedStep, drafts: DraftsAhead) -> FedAhead:
        """A shifted plan's inputs: each sequence feeds the token `feed` samples for it, then
        its drafts made ahead, its rows moved by the drafts `feed` kept of it. Where the plan
        has `feed`'s sequences in its order, each with a full row of drafts (the usual case),
        its rows are views of `feed`'s and of the drafts' tensors, not gathers."""
        width = 1 + drafts.table.shape[1]
        scheduled = plan.scheduled
        for item in scheduled:
            assert len(item.draft) <= drafts.depths[item.seq.seq_id], "a draft not made ahead"
        at_feed = self._feed_rows(plan, feed)
        table_rows = [drafts.rows[item.seq.seq_id] for item in scheduled]
        made = drafts.table[row_index(table_rows, drafts.table.shape[0], self.device)]
        shift = feed.verified.accepted[at_feed]
        # The drafts verified: those the room left after what `feed` kept (Scheduler.resolve).
        host = [len(item.draft) for item in scheduled] + [item.draft_room for item in scheduled]
        fed, rooms = to_device(host, self.device, torch.long).view(2, len(scheduled))
        counts = torch.minimum(fed, rooms - shift).clamp(min=0)
        columns = torch.arange(made.shape[1], device=self.device)
        padded = torch.where(columns[None, :] < counts[:, None], made, -1)
        # Rows past the drafts verified feed the drafts made there: valid tokens, never read.
        ids = torch.cat([feed.tokens[at_feed][:, None], made.clamp(min=0)], dim=1).flatten()
        row_shift = repeat_rows(shift, [1 + len(item.draft) for item in scheduled])
        if any(1 + len(item.draft) < width for item in scheduled):
            fed_rows = [
                b * width + j for b, i in enumerate(scheduled) for j in range(1 + len(i.draft))
            ]
            ids = ids[to_device(fed_rows, self.device)]
        return FedAhead(ids, row_shift, shift, padded, counts)

    def _decode_with_graph(self, plan: StepPlan, fed: torch.Tensor | None) -> GraphStep:
        """Logits, greedy tokens and hidden states of every scheduled sequence, one row each."""
        seqs = [item.seq for item in plan.scheduled]
        # The graphs are captured up to the scheduler's max_num_seqs.
        assert len(seqs) <= self.graphs.max_batch
        positions = [item.start for item in plan.scheduled]
        tables = [seq.block_ids for seq in seqs]
        if fed is not None:
            return self.executor.replay(False, None, positions, tables, fed_ids=fed)
        input_ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions, strict=True)]
        return self.executor.replay(False, input_ids, positions, tables)

    def _forward_eager(
        self, plan: StepPlan, fed: torch.Tensor | None, shifts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of every fed token, and the rows whose logits are sampled: each
        sampling sequence's last, and before it one per draft it fed. `shifts`: a shifted
        plan's offsets, one an item."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        for b, item in enumerate(plan.scheduled):
            seq, start, n = item.seq, item.start + (shifts[b] if shifts else 0), item.num_new_tokens
            if fed is None:
                input_ids.extend(seq.token_ids[start : start + n - len(item.draft)])
                input_ids.extend(item.draft)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
            if item.samples:
                sample_rows.extend(range(len(positions) - 1 - len(item.draft), len(positions)))
        ids = fed if fed is not None else input_ids
        hidden = self.executor.forward(ids, positions, query_lens, seq_lens, tables)
        return hidden, sample_rows


def _argmax_decides(sampling: list[ScheduledSeq], rows: list[SamplingRow]) -> bool:
    """Whether each row's token is its logits' argmax as the graph took it: every row greedy,
    without penalties or a logit bias, and unconstrained (a grammar masks the logits after the
    graph)."""
    return all(r.params.plain_argmax for r in rows) and all(
        item.seq.grammar is None for item in sampling
    )
