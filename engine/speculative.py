"""Speculative decoding: its configuration and the proposers that guess the next tokens.

A decode step of a speculating sequence feeds its last token and up to k proposed ("draft")
tokens; the target model scores all k + 1 positions in one forward, and engine.spec_verify keeps
the longest prefix of the drafts the target agrees with, plus one token of the target's own.
Proposals are deterministic token guesses (the n-gram's lookup, a draft model's argmax), so the
verifier's rejection sampling treats the proposal distribution as one-hot at each guess, and the
output distribution is exactly the target's.

Configured as vLLM's `--speculative-config`, a JSON object:

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "path/or/random:preset", "num_speculative_tokens": 3}
    {"method": "mtp", "num_speculative_tokens": 3}
    {"method": "eagle3", "model": "path/or/random:eagle3-<preset>", "num_speculative_tokens": 3}

Sequences that sample with penalties or under a grammar do not speculate (they decode one token a
step, as without speculation); log-probabilities are reported for every accepted token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np
import torch

from engine.host_values import to_device
from engine.kv_cache import KVCache
from engine.sequence import Sequence
from engine.step_plan import StepPlan

METHODS = ("ngram", "draft_model", "mtp", "eagle3")
WITH_MODEL = ("draft_model", "eagle3")
"""Methods whose proposer is a model of its own (speculative_config.model)."""
DRAFTS_AHEAD = ("mtp", "eagle3")
"""Methods whose proposer drafts a step's successor from its results on the device
(HiddenStateProposer.draft_ahead), so that steps may be planned ahead (async scheduling)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """"ngram" (prompt lookup), "draft_model" (a smaller model of the same vocabulary), "mtp"
    (the model's own multi-token-prediction layers, engine/mtp.py) or "eagle3" (an EAGLE-3 head
    fed the target's hidden states, engine/eagle.py)."""
    num_speculative_tokens: int
    """Draft tokens proposed per step and sequence at most (k)."""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix of the sequence looked up in its earlier tokens."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix looked up; no proposal when none of [min, max] is found."""
    model: str | None = None
    """draft_model: a Hugging Face folder or random:<preset>, of the target's vocabulary;
    eagle3: the head's folder, or random:eagle3-<preset>."""
    acceptance_curve: str | None = None
    """Benchmarks only: a curve name in engine/acceptance_curves.json; the verifier then
    accepts as many drafts as the curve draws instead of comparing them (output tokens are
    not the target's). Refused unless the engine is built in benchmark mode."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}"
            )
        if type(self.num_speculative_tokens) is not int or self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: {self.num_speculative_tokens!r} "
                "must be an integer of at least 1"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) and "
                f"prompt_lookup_max ({self.prompt_lookup_max}) must satisfy 1 <= min <= max"
            )
        if (self.method in WITH_MODEL) != (self.model is not None):
            raise ValueError(
                "speculative_config.model: a model is given with method draft_model or "
                f"eagle3, and only then (method {self.method!r}, model {self.model!r})"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From vLLM's --speculative-config JSON; unknown keys are refused by name."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(values, dict):
            raise ValueError("speculative_config: must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        missing = sorted({"method", "num_speculative_tokens"} - set(values))
        if missing:
            raise ValueError(f"speculative_config: missing {', '.join(missing)}")
        try:
            return cls(**values)
        except TypeError as e:  # a value of the wrong type met a comparison
            raise ValueError(f"speculative_config: {e}") from None

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


class Proposer(Protocol):
    kv_cache: KVCache | None
    """The proposer's own KV cache (a draft model's, the MTP layers'), addressed by the
    model's block ids; None for a proposer without one."""

    def propose(self, seqs: Seq[Sequence], rooms: Seq[int]) -> list[list[int]]:
        """Up to rooms[i] draft tokens to follow each sequence's tokens (all of them, the last
        one included, which has no KV yet). The blocks of every sequence already hold
        num_tokens + rooms[i] positions."""
        ...

    def fill_prompt(self, seqs: Seq[Sequence]) -> None:
        """Writes the proposer's KV of each sequence's positions before its last token and
        sets num_draft_computed to them (a prefill that has just sampled a sequence's first
        token sends this with the model's KV, and the decode server admits the sequence with
        num_draft_computed = its prompt length)."""
        ...


RowIndex = torch.Tensor | slice
"""Rows of a device tensor: an index tensor, or `slice(None)` for all of them (a view, no
kernel: the usual case, where every sequence has room for every draft)."""


def row_index(rows: list[int], total: int, device: torch.device) -> RowIndex:
    """`rows` of a device tensor of `total` rows: slice(None) where they are all of them in
    order, else an index tensor copied to `device`."""
    return slice(None) if rows == list(range(total)) else to_device(rows, device)


def repeat_rows(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """values[b] repeated counts[b] times, in order, on values' device: a broadcast where every
    count is the same (the usual case), else a gather by an index copied from the host."""
    if len(set(counts)) == 1:
        return values[:, None].expand(len(counts), counts[0]).flatten()
    index = [b for b, n in enumerate(counts) for _ in range(n)]
    return values[to_device(index, values.device)]


DraftStep = Callable[[int, list[int], RowIndex, torch.Tensor], torch.Tensor]
"""(j, rows, index, previous) -> draft j of the active sequences `rows` (`index`: the same
rows of a device tensor), after `previous`, their drafts j - 1."""


def chain_drafts(
    seqs: Seq[Sequence],
    active: Seq[tuple[Sequence, int]],
    first: torch.Tensor,
    step: DraftStep,
) -> list[list[int]]:
    """Each of `seqs`' drafts, from the first of every active (sequence, room) and `step` for
    each further one: only the sequences with room for draft j ride along in its step (their
    blocks hold its position; a shorter room's may end before it). One device read for all."""
    table = draft_table(active, first, step)
    by_seq = {
        seq.seq_id: row[:room] for (seq, room), row in zip(active, table.tolist(), strict=True)
    }
    return [by_seq.get(seq.seq_id, []) for seq in seqs]


def draft_table(
    active: Seq[tuple[Sequence, int]], first: torch.Tensor, step: DraftStep
) -> torch.Tensor:
    """[len(active), max room] on first's device: row i holds active[i]'s drafts, -1 past its
    room (chain_drafts, left on the device)."""
    depth = max(room for _, room in active)
    table = torch.full((len(active), depth), -1, dtype=torch.long, device=first.device)
    table[:, 0] = first
    for j in range(1, depth):
        rows = [i for i, (_, room) in enumerate(active) if room > j]
        index = row_index(rows, len(active), first.device)
        table[index, j] = step(j, rows, index, table[index, j - 1])
    return table


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) earlier in its prompt and output, and propose what followed the most
    recent such occurrence."""

    kv_cache = None

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def fill_prompt(self, seqs: Seq[Sequence]) -> None:
        """Nothing: a lookup needs the tokens only."""

    def propose(self, seqs: Seq[Sequence], rooms: Seq[int]) -> list[list[int]]:
        return [
            self.lookup(seq.token_ids, room) if room > 0 else []
            for seq, room in zip(seqs, rooms, strict=True)
        ]

    def lookup(self, token_ids: Seq[int], room: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]
            # Windows starting at 0 .. total - n - 1: every occurrence but the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                follow = int(hits[-1]) + n
                return tokens[follow : follow + room].tolist()
        return []


@dataclass
class SpecStats:
    """An engine's speculation counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0
    """Verified proposals: sequence-steps that fed at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[j]: proposals whose draft j was accepted."""

    def record_step(self, plan: StepPlan, accepted: dict[str, int], depth: int) -> None:
        """Counts a read step's verifications, here and in each sequence's counters (`depth`:
        num_speculative_tokens, its acceptance histogram's last index)."""
        for item in plan.scheduled:
            if item.draft:
                seq, kept = item.seq, accepted[item.seq.seq_id]
                seq.num_draft_tokens += len(item.draft)
                seq.num_accepted_tokens += kept
                if seq.acceptance_histogram is None:
                    seq.acceptance_histogram = [0] * (depth + 1)
                seq.acceptance_histogram[kept] += 1
                self.record(len(item.draft), kept)

    def record(self, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified proposal yields on average: accepted drafts + the target's one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
