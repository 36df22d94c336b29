"""A step queued on the device (ModelRunner.launch), and how the host reads its results: the
sampled tokens (and log-probabilities where asked) come back through pinned memory when the
device gets there, so the host can plan and launch the next step meanwhile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.prompt_logprobs import PromptLogprobTensors
from engine.sampling import LogprobTensors, TokenLogprobs, to_pinned
from engine.step_plan import StepPlan

if TYPE_CHECKING:
    from engine.hidden_proposer import DraftsAhead


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
        """What the step runs; a shifted plan is replaced by its resolved one (Scheduler.resolve)
        once the host has read the step before."""
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
        self.prompt_logprobs: dict[str, PromptLogprobTensors] = {}
        """Prompt entries the step computed (engine/prompt_logprobs.py), by sequence."""
        self.verified: Verified | None = None
        """A step that fed drafts: its verification's results, on the device."""
        self.shift: torch.Tensor | None = None
        """A shifted step (StepPlan.shifted): [sampling sequences] the positions the device
        added to each one's."""
        self.fed_drafts: DraftsAhead | None = None
        """A shifted step: the drafts made ahead that it fed (their values resolve its plan)."""
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
