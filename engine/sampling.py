"""Sampling: per-request parameters and a batched sampler over one step's logits.

Every supported knob is a field of `SamplingParams`; `SamplingParams.from_dict` rejects any other
key by name, so a request never has a parameter silently dropped. The sampler works on the whole
batch at once (one [B, V] pass per knob), and only pays for the knobs some row uses; so does
`compute_logprobs`, which only runs when some row asks for log-probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch

from engine.host_values import to_device
from engine.sampling_ranges import (
    SAMPLING_RANGES,
    SEED_END,
    allowed_token_ids_of,
    logit_bias_pairs,
    range_problem,
)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token of one request."""

    temperature: float = 0.0
    """0 = greedy (argmax); otherwise logits are divided by it. In [0, 2]."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = no limit."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (divides positive logits)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated. In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of every token already generated. In [-2, 2]."""
    logprobs: int | None = None
    """Report each sampled token's log-probability and this many (0-20) most likely tokens'
    (vLLM's `logprobs`, its default raw_logprobs mode: from the raw logits, before penalties,
    temperature and filtering; after a structured output's grammar mask, as in vLLM, so tokens
    the grammar refuses have -inf). None: nothing is computed."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, sorted by id, added to the logits before penalties and sampling
    (OpenAI's logit_bias, clamped to [-100, 100]; given as a {token id: bias} mapping, it is
    converted); not seen by `logprobs`, as vLLM's raw log-probabilities."""
    prompt_logprobs: int | None = None
    """Report each prompt token's log-probability (after the first), its rank and this many
    (0-20) most likely tokens' at its position (vLLM's `prompt_logprobs`; raw, as `logprobs`).
    Computed where the prompt is prefilled (engine/prompt_logprobs.py). None: nothing is."""

    allowed_token_ids: tuple[int, ...] = ()
    """vLLM's `allowed_token_ids`: only these tokens are sampled (the others' logits -inf,
    before the logit bias and the penalties); not seen by the logprobs, as vLLM's raw ones.
    Empty: every token."""

    def __post_init__(self) -> None:
        # Frozen: the normal form is written once, here, whatever form it was given in.
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids != ():  # an empty list given is refused, not "every token"
            allowed = allowed_token_ids_of(self.allowed_token_ids)
            object.__setattr__(self, "allowed_token_ids", allowed)
        for name, allowed in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            problem = range_problem(name, value)
            # A real int: a float would reach topk() or a generator on the engine thread.
            if problem is None and allowed.integer and type(value) is not int:
                problem = f"{name}: {value!r} is not an integer"
            if problem:
                raise ValueError(problem)

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> SamplingParams:
        """Builds params from a request's fields; unknown keys are rejected by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def for_choice(self, index: int) -> SamplingParams:
        """Choice `index`'s params among a request's n (OpenAI's n): a seed becomes seed + index
        (mod 2**64), as vLLM gives its child requests; unseeded choices are independent draws.
        The prompt's log-probabilities are choice 0's to compute (the prompt is the same)."""
        if index == 0:
            return self
        seed = None if self.seed is None else (self.seed + index) % SEED_END
        return replace(self, seed=seed, prompt_logprobs=None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_argmax(self) -> bool:
        """Greedy on the model's logits as they are: no penalty or bias changes them."""
        return self.greedy and not (self.penalized or self.logit_bias or self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probabilities: log_softmax of the model's float32 logits."""

    logprob: float
    """The sampled token's."""
    top_token_ids: tuple[int, ...]
    """The SamplingParams.logprobs most likely tokens, most likely first."""
    top_logprobs: tuple[float, ...]
    """Theirs, in the same order."""
    rank: int | None = None
    """A prompt token's rank at its position (1: the most likely); None for sampled ones."""


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
"""SamplingParams' field names, in order; tandem.v1.SamplingParams has one optional field of
each name (decode/tests/service_test.py checks that), so a server copies the fields a request
set by these names."""


@dataclass(frozen=True)
class SamplingRow:
    """One row of a sampling batch: the request's params and what penalties need to see."""

    params: SamplingParams
    generator: torch.Generator | None
    """Advanced once per sampled token; None = the sampler's shared generator."""
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


class Sampler:
    """Samples one token per row of a [B, vocab] float32 logits tensor."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        excluded: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the sampled token ids, int64 [B], on logits' device. `excluded` [B]: a token
        per row whose probability is zeroed after filtering, the rest renormalized (-1: none;
        sampled rows only): speculative decoding's residual distribution after a rejected
        one-hot draft (engine/spec_verify.py)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows)
        logits = logits.float()
        if any(r.params.allowed_token_ids for r in rows):
            logits = _allowed_only(logits, rows)
        if any(r.params.logit_bias for r in rows):  # decided on the host, as the penalties
            logits = _apply_logit_bias(logits, rows)
        if any(r.params.penalized for r in rows):
            logits = _apply_penalties(logits, rows)
        flags = [r.params.greedy for r in rows]
        if all(flags):  # decided on the host: no device round trip on the common path
            return logits.argmax(dim=-1)
        greedy = to_device(flags, logits.device)
        probs = self.filtered_probs(logits, rows)
        if excluded is not None:
            keep = excluded >= 0
            column = excluded.clamp(min=0)[:, None]
            kept = torch.where(keep[:, None], 0.0, probs.gather(1, column))
            probs = probs.scatter(1, column, kept)
        sampled = self._race(probs, rows)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def filtered_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[B, vocab] float32 probabilities each row samples from: temperature, then top-k,
        top-p and min-p (zeroed tokens; rows are not renormalized, the race does not need it).
        Penalties are the caller's."""
        device = logits.device
        temps = to_device([r.params.temperature or 1.0 for r in rows], device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        vocab = logits.shape[1]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            probs = _top_k_top_p(
                probs,
                to_device(top_k, device),
                to_device(top_p, device),
            )
        if any(r.params.min_p > 0 for r in rows):  # decided on the host: no device sync
            min_p = to_device([r.params.min_p for r in rows], device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _race(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Samples via argmax(p / E), E ~ Exp(1) i.i.d.: one draw per row, no CDF search, and a
        per-request generator only touches its own row (so seeded rows are reproducible)."""
        noise = torch.empty_like(probs)
        shared = self.shared_generator(probs.device)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator or shared)
        return (probs / noise).argmax(dim=-1)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed)
            self._shared[device] = gen
        return self._shared[device]


@dataclass(frozen=True)
class LogprobTensors:
    """One step's log-probabilities, one row per row of the batch (rows that did not ask
    included: leaving them out would cost a copy of the row indices to the device)."""

    chosen: torch.Tensor
    """float32 [B]: the sampled token's."""
    top_logprobs: torch.Tensor
    """float32 [B, k]: the k most likely tokens', most likely first (k: the batch's largest
    SamplingParams.logprobs)."""
    top_token_ids: torch.Tensor
    """int64 [B, k]."""

    def to_host(self) -> LogprobTensors:
        """Copies queued into pinned host memory: valid once the device has got there (the
        caller records an event after them)."""
        return LogprobTensors(
            *(to_pinned(t) for t in (self.chosen, self.top_logprobs, self.top_token_ids))
        )

    def rows(self, wanted: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Each row's TokenLogprobs with its own `wanted` alternatives (None: the row did not
        ask). On host tensors: reads them."""
        chosen = self.chosen.tolist()
        top_logprobs, top_ids = self.top_logprobs.tolist(), self.top_token_ids.tolist()
        return [
            None if n is None else TokenLogprobs(lp, tuple(ids[:n]), tuple(values[:n]))
            for n, lp, ids, values in zip(wanted, chosen, top_ids, top_logprobs, strict=True)
        ]


def to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor t queued into pinned host memory: valid once the device has got
    there (the caller records an event after it)."""
    return torch.empty_like(t, device="cpu", pin_memory=True).copy_(t, non_blocking=True)


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow]
) -> LogprobTensors | None:
    """The log-probabilities of the sampled `tokens` [B] and of each row's most likely tokens,
    from the raw logits [B, vocab] (vLLM's raw_logprobs: before penalties, temperature and
    filtering). None, with nothing launched, when no row asks."""
    wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    if not wanted:  # decided on the host: no log_softmax for batches that do not ask
        return None
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(min(max(wanted), logprobs.shape[1]), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return LogprobTensors(chosen, top.values, top.indices)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens outside each row's top-k and nucleus; rows keep at least their argmax."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    outside = rank >= top_k[:, None]
    # Mass strictly before each token: a token is kept while that mass is below top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside |= mass_before >= top_p[:, None]
    outside[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _allowed_only(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits with -inf outside each row's allowed_token_ids (a new tensor; rows without any
    as they are)."""
    restricted = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    where = [(i, token) for i in restricted for token in rows[i].params.allowed_token_ids]
    index = to_device(list(zip(*where, strict=True)), logits.device)
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    blocked[to_device(restricted, logits.device)] = True
    blocked[index[0], index[1]] = False
    return logits.masked_fill(blocked, float("-inf"))


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits plus each row's logit_bias (a new tensor), the ids and biases in one upload."""
    where = [(i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias]
    row_ids, token_ids, biases = zip(*where, strict=True)
    index = to_device([row_ids, token_ids], logits.device)
    values = to_device(biases, logits.device, torch.float32)
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM/OpenAI semantics: repetition over prompt and output; presence, frequency over output."""
    batch, vocab = logits.shape
    device = logits.device
    output_counts = torch.zeros(batch, vocab, device=device)
    seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if not row.params.penalized:
            continue
        if row.output_ids:
            ids = to_device(row.output_ids, device)
            output_counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
        if row.prompt_ids:
            seen[i, to_device(row.prompt_ids, device)] = True
    seen |= output_counts > 0
    rep = to_device([r.params.repetition_penalty for r in rows], device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = to_device([r.params.frequency_penalty for r in rows], device)[:, None]
    pres = to_device([r.params.presence_penalty for r in rows], device)[:, None]
    return logits - freq * output_counts - pres * (output_counts > 0).float()
