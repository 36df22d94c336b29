"""The valid range of every sampling parameter, in one table that the engine's SamplingParams
and the router's request checks both read (the router refuses a bad value with a 400 before any
engine sees it; the engine refuses it again for callers that skip the router). No torch here:
the router imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAX_LOGPROBS = 20
"""Alternatives per token at most (vLLM's default --max-logprobs, OpenAI's top_logprobs)."""
MAX_N = 16384
"""Choices (sequences) one request may ask for at most (vLLM's default VLLM_MAX_N_SEQUENCES);
the router's OpenAI API allows 128."""
SEED_END = 2**64
"""Seeds are unsigned 64-bit (torch.Generator.manual_seed's range)."""


@dataclass(frozen=True)
class Range:
    accepts: Callable[[float], bool]
    text: str
    """The range, as an error message states it: "in [0, 100]"."""
    integer: bool = False


_LOGPROBS = Range(lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]", integer=True)
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(lambda v: 0.0 <= v <= 2.0, "in [0, 2]"),
    "top_p": Range(lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": Range(lambda v: v >= 0, "0 (no limit) or more", integer=True),
    "min_p": Range(lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "seed": Range(lambda v: 0 <= v < SEED_END, "in [0, 2**64)", integer=True),
    "repetition_penalty": Range(lambda v: 0.0 < v <= 100.0, "in (0, 100]"),
    "presence_penalty": Range(lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": Range(lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "logprobs": _LOGPROBS,
    "prompt_logprobs": _LOGPROBS,
}


def range_problem(name: str, value: object) -> str | None:
    """Why `value` is no valid `name` ("top_p: 2 is not in (0, 1]"), or None if it is."""
    allowed = SAMPLING_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name}: {value!r} is not a number"
    if allowed.integer and not (isinstance(value, int) or value.is_integer()):
        return f"{name}: {value!r} is not an integer"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name}: {value!r} is not a finite number"
    if not allowed.accepts(value):
        return f"{name}: {value!r} is not {allowed.text}"
    return None


def checked_sampling_value(name: str, value: object) -> int | float:
    """A sampling field's value as tandem.v1.SamplingParams takes it (an int for the integer
    fields, 2.0 included; a float otherwise), under vLLM's convention that top_k -1 is no
    limit. ValueError with range_problem's message when it is no valid `name`."""
    if name == "top_k" and value == -1:
        value = 0
    problem = range_problem(name, value)
    if problem:
        raise ValueError(problem)
    return int(value) if SAMPLING_RANGES[name].integer else float(value)


LOGIT_BIAS_BOUND = 100.0
"""A logit bias is clamped to [-100, 100]: OpenAI's range, clamped as vLLM clamps it."""


def logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({token id: bias}, the id a string in JSON; or (id, bias) pairs) as
    (id, bias) pairs sorted by id, each bias clamped to [-100, 100] as vLLM does. ValueError,
    naming the entry, for an id that is no integer or is negative, or a bias that is no number.
    Ids above the vocabulary are the caller's to refuse (it knows the model)."""
    if not isinstance(value, Mapping):
        try:
            value = dict(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            kind = type(value).__name__
            raise ValueError(
                f"logit_bias: a {kind}, not an object of token ids to biases"
            ) from None
    pairs = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None:
            raise ValueError(f"logit_bias: key {key!r} is not a token id (an integer, at least 0)")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
            raise ValueError(f"logit_bias: the bias of {key!r}, {bias!r}, is not a number")
        pairs[token] = min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, float(bias)))
    return tuple(sorted(pairs.items()))


def allowed_token_ids_of(value: object) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids` (the only tokens sampled): a non-empty list of token ids, as
    a sorted tuple without repeats. ValueError naming the entry; ids above the vocabulary are
    the caller's to refuse."""
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__iter__"):
        raise ValueError(f"allowed_token_ids: a {type(value).__name__}, not a list of token ids")
    ids = list(value)
    if not ids:
        raise ValueError("allowed_token_ids: empty; leave it out to allow every token")
    for token in ids:
        if type(token) is not int or token < 0:
            raise ValueError(f"allowed_token_ids: {token!r} is not a token id (an integer, at "
                             "least 0)")  # fmt: skip
    return tuple(sorted(set(ids)))


def vocabulary_problem(
    logit_bias: tuple[tuple[int, float], ...], allowed_token_ids: tuple[int, ...], vocab_size: int
) -> str | None:
    """Why `logit_bias_pairs`' pairs or `allowed_token_ids_of`'s ids do not fit a model of
    `vocab_size` tokens, or None."""
    if logit_bias and logit_bias[-1][0] >= vocab_size:  # sorted by id
        token = logit_bias[-1][0]
        return f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})"
    if allowed_token_ids and allowed_token_ids[-1] >= vocab_size:
        token = allowed_token_ids[-1]
        return f"allowed_token_ids: token id {token} is outside the vocabulary [0, {vocab_size})"
    return None


def _token_id(key: object) -> int | None:
    """key as a token id ("50256" or 50256), or None."""
    if isinstance(key, str) and key.strip().lstrip("+").isdecimal():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        return None
    return key


def sampling_fields(message) -> dict[str, object]:
    """The fields a tandem.v1.SamplingParams sets, by name (as SamplingParams and vLLM's
    requests name them): logit_bias, a map, as a dict, allowed_token_ids as a list, each only
    when it has entries."""
    return {
        f.name: dict(v) if f.message_type else list(v) if f.is_repeated else v
        for f, v in message.ListFields()
    }
