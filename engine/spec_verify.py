"""Verification of speculated tokens: which drafts the target keeps, and the token it adds.

Sequence b fed its last token and drafts d_0 .. d_{n_b - 1} at consecutive positions, so the
target's logits rows r_0 .. r_{n_b} score the tokens after each of them (rows of one sequence
are consecutive, sequences in batch order). Draft j is accepted when every draft before it was,
and:
  - greedy rows: d_j is the argmax of row r_j;
  - sampled rows (rejection sampling with a one-hot proposal): u_j < p_j(d_j), u_j ~ U(0, 1),
    p_j the row's filtered distribution (temperature, top-k, top-p, min-p), as the sampler
    would sample from it.
With a drafts accepted, the sequence also gets one token of the target's: from row r_a, sampled
from p_a with d_a's mass removed when d_a was rejected (the residual max(0, p - q) of a
one-hot q), or from p_{n_b} unchanged when every draft was accepted. The tokens a sequence gets
are then distributed exactly as the target's own samples, one at a time.

Everything stays on the device: the host learns per sequence the number accepted and the
target's token when it reads the step's results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.host_values import to_device
from engine.sampling import Sampler, SamplingRow


def verify(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    rows: Sequence[SamplingRow],
    sampler: Sampler,
    simulated: Sequence[int] | None = None,
    padded: torch.Tensor | None = None,
    verified: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], accepted [B], row_tokens [sum(n_b + 1)]), int64 on logits' device: each
    sequence's own token, its number of accepted drafts, and the token each row's logits
    produced (row r_j: draft j where accepted, the sequence's own token at r_a; rows past it
    repeat that token, and nothing reads them). logits [sum(n_b + 1), vocab] float32.
    `simulated`: accepted counts drawn by an acceptance curve (benchmarks), used instead of the
    comparison, clipped at each sequence's drafts; the target's token is then drawn from row
    r_a unchanged. `padded` [B, width >= max n_b]: the drafts, on the device already (-1 past
    each sequence's), where `drafts` holds placeholders of their lengths; `verified` [B]: how
    many of each are verified, on the device (<= n_b: its rows past those are ignored);
    `greedy` [sum(n_b + 1)]: each row's argmax, already taken (a CUDA graph's), where every
    row is greedy on the logits as they are (`SamplingParams.plain_argmax`): the tokens are
    then read from it, no sampler launched."""
    device = logits.device
    counts = [len(d) for d in drafts]
    width = max(counts)
    assert width >= 1, "verify() of a step without drafts"
    # The host's values in one copy: each a copy of its own is a kernel's launch and more.
    batch = len(counts)
    host = _starts(counts) + (counts if verified is None else []) + list(simulated or [])
    uploaded = to_device(host, device, torch.long)
    starts = uploaded[:batch]
    count_t = uploaded[batch : 2 * batch] if verified is None else verified
    if padded is None:
        padded = to_device([list(d) + [-1] * (width - len(d)) for d in drafts], device)
    if simulated is not None:
        accepted = torch.minimum(uploaded[-batch:], count_t)
        excluded = None
    else:
        argmax = greedy if greedy is not None else logits.argmax(dim=-1)
        accepted = _accepted(logits, argmax, padded, count_t, starts, rows, sampler)
        # The draft at the first rejected position, when there is one (else -1: none).
        at = padded.gather(1, accepted.clamp(max=width - 1)[:, None]).squeeze(1)
        excluded = torch.where(accepted < count_t, at, -1)
    final_rows = starts + accepted
    if greedy is not None:
        tokens = greedy[final_rows]
    else:
        tokens = sampler(logits[final_rows], rows, excluded)
    # grid[b, j]: the token row j of sequence b gave (draft j where accepted, then b's own);
    # its rows are the sequences' rows where every sequence fed `width` drafts (the usual case).
    columns = torch.arange(width + 1, device=device)
    drafted = F.pad(padded[:, :width], (0, 1), value=-1)
    grid = torch.where(columns[None, :] < accepted[:, None], drafted, tokens[:, None]).flatten()
    if all(n == width for n in counts):
        return tokens, accepted, grid
    flat = [b * (width + 1) + j for b, n in enumerate(counts) for j in range(n + 1)]
    return tokens, accepted, grid[to_device(flat, device)]


def _accepted(
    logits: torch.Tensor,
    argmax: torch.Tensor,
    padded: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    rows: Sequence[SamplingRow],
    sampler: Sampler,
) -> torch.Tensor:
    """[B]: each sequence's leading run of accepted drafts (argmax: each row's, for the
    greedy ones)."""
    batch, width = padded.shape
    index = starts[:, None] + torch.arange(width, device=logits.device)[None, :]
    index = torch.minimum(index, (starts + counts)[:, None])  # padding: the sequence's last row
    valid = torch.arange(width, device=logits.device)[None, :] < counts[:, None]
    accept = padded == argmax[index]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:  # decided on the host: greedy batches compute no probabilities
        flat = index.flatten()
        expanded = [rows[i // width] for i in range(batch * width)]
        probs = sampler.filtered_probs(logits[flat], expanded)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        p_draft = probs.gather(1, padded.clamp(min=0).flatten()[:, None]).view(batch, width)
        uniform = _uniforms(rows, width, logits.device, sampler)
        greedy = to_device([row.params.greedy for row in rows], logits.device)
        accept = torch.where(greedy[:, None], accept, uniform < p_draft)
    accept &= valid
    return accept.long().cumprod(dim=1).sum(dim=1)


def _uniforms(
    rows: Sequence[SamplingRow], width: int, device: torch.device, sampler: Sampler
) -> torch.Tensor:
    """[B, width] U(0, 1) draws of the sampled rows, each from its own generator (seeded
    requests stay reproducible) or the sampler's shared one."""
    out = torch.zeros(len(rows), width, device=device)
    for i, row in enumerate(rows):
        if not row.params.greedy:  # a greedy row's generator is left as it was
            out[i].uniform_(generator=row.generator or sampler.shared_generator(device))
    return out


def _starts(counts: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for n in counts:
        starts.append(total)
        total += n + 1
    return starts
