"""Prompt log-probabilities (vLLM's `prompt_logprobs`): for each prompt token after the first,
its log-probability given the tokens before it, its rank, and the k most likely tokens there.

A prompt chunk's forward has the hidden state of every position; a sequence that asks has the
logits of its chunk's positions computed too (only the last one's otherwise), in slices of
SLICE_ROWS rows so that a long chunk never holds [chunk, vocab] float32 logits at once. Position
p gives prompt token p + 1's entry; the prompt's last position gives the first sampled token,
which is no prompt token. Entries a sequence has (it was preempted and computes its prompt
again) are not computed twice. A sequence that asks takes no KV from the prefix cache (vLLM
skips it likewise): the cached positions would have no logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sampling import TokenLogprobs
from engine.step_plan import StepPlan

SLICE_ROWS = 512
"""Positions whose logits exist at once: 512 x a 152k vocabulary is 311 MB of float32."""


@dataclass(frozen=True)
class PromptSpan:
    """The rows of one sequence's prompt chunk whose entries the step computes."""

    seq_id: str
    rows: list[int]
    """Rows of the step's hidden states (the eager forward's order)."""
    targets: list[int]
    """The prompt token each row predicts."""
    top: int
    """How many of the most likely tokens each entry lists (SamplingParams.prompt_logprobs)."""


def prompt_spans(plan: StepPlan) -> list[PromptSpan]:
    """The plan's rows whose logits give prompt entries not yet computed; none when no
    sequence asks. Rows are counted as ModelRunner._forward_eager lays them out."""
    spans, row = [], 0
    for item in plan.scheduled:  # NOTE: every step's; one attribute test for most items
        seq, top = item.seq, item.seq.sampling.prompt_logprobs
        if top is None:
            row += item.num_new_tokens
            continue
        end = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
        if item.start < end:  # a chunk before the prompt's last position
            # Every position before the chunk gave its entry (no cached KV was taken).
            assert item.start <= len(seq.prompt_logprobs), "prompt positions without entries"
            first = max(item.start, len(seq.prompt_logprobs))
            if first < end:
                rows = list(range(row + first - item.start, row + end - item.start))
                spans.append(PromptSpan(seq.seq_id, rows, seq.token_ids[first + 1 : end + 1], top))
        row += item.num_new_tokens
    return spans


@dataclass(frozen=True)
class PromptLogprobTensors:
    """One sequence's entries of one step, on the device until `entries` reads them."""

    chosen: torch.Tensor
    """float32 [rows]: each prompt token's log-probability."""
    ranks: torch.Tensor
    """int64 [rows]: its rank (1: the most likely; ties count against it, as vLLM's)."""
    top_logprobs: torch.Tensor
    """float32 [rows, top]: the most likely tokens', most likely first."""
    top_token_ids: torch.Tensor
    """int64 [rows, top]."""

    def entries(self) -> list[TokenLogprobs]:
        """As TokenLogprobs, one a row; waits for the device."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        values, ids = self.top_logprobs.tolist(), self.top_token_ids.tolist()
        return [
            TokenLogprobs(lp, tuple(i), tuple(v), rank)
            for lp, rank, v, i in zip(chosen, ranks, values, ids, strict=True)
        ]


def compute_prompt_logprobs(
    spans: Sequence[PromptSpan], logits_of: Callable[[list[int]], torch.Tensor]
) -> dict[str, PromptLogprobTensors]:
    """Each span's entries, from `logits_of(rows)` (float32 [rows, vocab] of the step's
    hidden states), SLICE_ROWS rows at a time."""
    out = {}
    for span in spans:
        parts = []
        for at in range(0, len(span.rows), SLICE_ROWS):
            rows = span.rows[at : at + SLICE_ROWS]
            targets = torch.tensor(span.targets[at : at + SLICE_ROWS])
            parts.append(_slice_logprobs(logits_of(rows), targets, span.top))
        out[span.seq_id] = PromptLogprobTensors(*(torch.cat(t) for t in zip(*parts, strict=True)))
    return out


def _slice_logprobs(logits: torch.Tensor, targets: torch.Tensor, top: int) -> tuple:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.to(logprobs.device)[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    best = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
    return chosen.squeeze(1), ranks, best.values, best.indices
