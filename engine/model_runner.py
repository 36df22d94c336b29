"""Runs one StepPlan: packs the scheduled tokens, runs the model, samples the next tokens.

Decode-only steps on CUDA replay a captured graph (engine/cuda_graphs.py); everything else
(prefill chunks, mixed batches, CPU) runs the model eagerly. Rows of constrained sequences
(structured output) have their grammar's mask applied to the logits, after the graph, before
sampling.

`launch` returns as soon as the work is queued on the device: the sampled tokens (and the
log-probabilities of the sequences that ask for them) come back to the host through pinned memory
when the device gets there (`LaunchedStep.result`, `LaunchedStep.logprobs`). A step
planned ahead (engine.scheduler.schedule_ahead) feeds the tokens of the step before it, still on
the device, as its input ids.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.cuda_graphs import DecodeGraphs, GraphStep
from engine.grammar import apply_grammars
from engine.host_values import to_device
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampling import (
    LogprobTensors,
    Sampler,
    SamplingRow,
    TokenLogprobs,
    compute_logprobs,
    to_pinned,
)
from engine.scheduler import ScheduledSeq, StepPlan
from engine.spec_acceptance import AcceptanceCurve
from engine.spec_verify import verify
from engine.step_executor import StepExecutor


class Verified(NamedTuple):
    """A verification's results on the device (engine/spec_verify.py), before the host reads
    them: what a proposer needs to draft the next step at once (HiddenStateProposer.draft_ahead)."""

    row_tokens: torch.Tensor
    """[fed rows]: the token after each fed row's position (accepted drafts, then the target's)."""
    accepted: torch.Tensor
    """[sampling sequences]: each one's accepted drafts."""


class LaunchedStep:
    """A forward queued on the device, and the tokens it samples."""

    def __init__(
        self,
        plan: StepPlan,
        seq_ids: list[str],
        tokens: torch.Tensor | None,
        host: torch.Tensor | None = None,
        logprobs: LogprobTensors | None = None,
        accepted: torch.Tensor | None = None,
        rows_per_seq: list[int] | None = None,
    ) -> None:
        self.plan = plan
        self.tokens = tokens
        """The sampled token of each sampling sequence, in plan order, on the device."""
        self._accepted = accepted
        """A step that fed drafts: how many of each sampling sequence's the target kept."""
        self._rows_per_seq = rows_per_seq
        """A step that fed drafts: each sampling sequence's rows of `logprobs` (drafts + 1)."""
        self.seq_ids = seq_ids
        """The sampling sequences' ids, in the order of `tokens`."""
        self._host = host
        self._logprobs = logprobs
        """None when no sequence asked; on the host once `_copied` has happened."""
        self.hidden: torch.Tensor | None = None
        """CausalLM.proposer_hidden of every fed row, in plan order (a sequence's rows
        together), set by the runner: a proposer fed hidden states reads it
        (engine/hidden_proposer.py). A graph's buffer: valid until the next step."""
        self.verified: Verified | None = None
        """A step that fed drafts: its verification's results, on the device."""
        self._copied: torch.cuda.Event | None = None
        if host is not None:  # CUDA: the copy to pinned memory lands when the device gets there
            host.copy_(tokens, non_blocking=True)
            if logprobs is not None:
                self._logprobs = logprobs.to_host()
            if accepted is not None:
                self._accepted = to_pinned(accepted)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> dict[str, int]:
        """{seq_id: sampled token}; waits for the device."""
        if not self.seq_ids:
            return {}
        if self._copied is not None:
            self._copied.synchronize()
            values = self._host.tolist()
        else:
            values = self.tokens.tolist()
        return dict(zip(self.seq_ids, values, strict=True))

    def accepted(self) -> dict[str, int]:
        """{seq_id: drafts the target accepted} for the sequences that fed drafts; waits for
        the device."""
        if self._accepted is None:
            return {}
        if self._copied is not None:
            self._copied.synchronize()
        counts = dict(zip(self.seq_ids, self._accepted.tolist(), strict=True))
        drafted = [item.seq.seq_id for item in self.plan.scheduled if item.draft]
        return {seq_id: counts[seq_id] for seq_id in drafted}

    def logprobs(self) -> dict[str, list[TokenLogprobs]]:
        """{seq_id: the log-probabilities of each token the step gives it (its accepted drafts,
        then the sampled one)}, for the sequences that asked (SamplingParams.logprobs); waits
        for the device."""
        if self._logprobs is None:
            return {}
        if self._copied is not None:
            self._copied.synchronize()
        wanted = [item.seq.sampling.logprobs for item in self.plan.scheduled if item.samples]
        per_seq = self._rows_per_seq or [1] * len(wanted)
        expanded = [n for n, count in zip(wanted, per_seq, strict=True) for _ in range(count)]
        rows = self._logprobs.rows(expanded)
        accepted = self.accepted()
        out, start = {}, 0
        for seq_id, n, count in zip(self.seq_ids, wanted, per_seq, strict=True):
            if n is not None:
                out[seq_id] = rows[start : start + accepted.get(seq_id, 0) + 1]
            start += count
        return out


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
        self, plan: StepPlan, feed: LaunchedStep | None = None, eager: bool = False
    ) -> LaunchedStep:
        """Queues one forward over the plan and the sampling of every sequence that samples.
        `feed`: the step before a step planned ahead, whose tokens are this one's input ids.
        `eager`: no graph replay, even for a decode-only plan (a prompt's last one-token chunk
        whose layers the prefill sends as they are written)."""
        sampling = [item for item in plan.scheduled if item.samples]
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
            logits, hidden = self._verify_with_graph(plan)
        else:
            hidden, sample_rows = self._forward_eager(plan, fed)
            hidden = self.model.proposer_hidden(hidden)  # the graphs' hidden is that already
            if not sampling:  # a prompt chunk: its hidden states only
                step = LaunchedStep(plan, [], None)
                step.hidden = hidden
                return step
            logits = self.executor.logits(sample_rows)
        rows = [item.seq.sampling_row() for item in sampling]
        if any(item.draft for item in sampling):
            step = self._verify(plan, sampling, logits, rows)
        else:
            step = self._sample(plan, sampling, logits, greedy, rows, feed)
        step.hidden = hidden
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
            greedy = None
        if greedy is not None and all(r.params.greedy and not r.params.penalized for r in rows):
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
        rows: list[SamplingRow],
    ) -> LaunchedStep:
        """The step's tokens when some sequence fed drafts: logits has one row per fed token
        of those, one per sequence otherwise (engine/spec_verify.py)."""
        drafts = [item.draft for item in sampling]
        simulated = None
        if self.acceptance is not None:
            simulated = [self.acceptance.draw(len(d)) if d else 0 for d in drafts]
        tokens, accepted, row_tokens = verify(logits, drafts, rows, self.sampler, simulated)
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

    def _verify_with_graph(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the sampling sequences' rows (each fed token of theirs), and every row's
        hidden state: a graph replay with a row per fed token, at its position, with its
        sequence's block table."""
        ids, positions, tables, sample_rows = [], [], [], []
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            if item.samples:
                sample_rows.extend(range(len(ids), len(ids) + n))
            ids.append(seq.token_ids[item.start])
            ids.extend(item.draft)
            positions.extend(range(item.start, item.start + n))
            tables.extend([seq.block_ids] * n)
        logits, _, hidden = self.executor.replay(True, ids, positions, tables)
        if len(sample_rows) < len(ids):  # a one-token prompt chunk rode along
            logits = logits[to_device(sample_rows, self.device)]
        return logits, hidden

    def _next_host(self, n: int) -> torch.Tensor | None:
        if not self._host_tokens:
            return None
        self._launches += 1
        return self._host_tokens[self._launches % 2][:n]

    def _fed_ids(self, plan: StepPlan, feed: LaunchedStep) -> torch.Tensor:
        """The input ids of a step planned ahead: the tokens `feed` samples for its sequences
        (one of `feed` that has finished, or stops on its length there, has no row in `plan`)."""
        seq_ids = [item.seq.seq_id for item in plan.scheduled]
        if seq_ids == feed.seq_ids:
            return feed.tokens
        row = {seq_id: i for i, seq_id in enumerate(feed.seq_ids)}
        return feed.tokens[to_device([row[s] for s in seq_ids], self.device)]

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
        self, plan: StepPlan, fed: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of every fed token, and the rows whose logits are sampled: each
        sampling sequence's last, and before it one per draft it fed."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
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
