"""Checks of single values of an OpenAI body, each refusal a RequestError naming its field:
booleans, integers (an integral float is one, as vLLM's pydantic models take it), seeds,
max_tokens, stop strings, token ids and logit_bias."""

from __future__ import annotations

from engine.sampling_ranges import allowed_token_ids_of, logit_bias_pairs, vocabulary_problem
from router.errors import RequestError

_INT64 = 2**63
MAX_STOPS = 4
"""Stop strings per request at most (vLLM's default VLLM_MAX_STOP_STRINGS, OpenAI's limit)."""


def flag(body: dict, name: str, default: bool) -> bool:
    """body[name], a JSON boolean, or `default` when absent."""
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(400, f"{name}: {value!r} is not true or false", name)
    return value


def logit_bias(value: object, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token id, bias) pairs; none for null."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestError(400, "logit_bias: must be an object of token ids to biases",
                           "logit_bias")  # fmt: skip
    try:
        pairs = logit_bias_pairs(value)
    except ValueError as e:
        raise RequestError(400, str(e), "logit_bias") from None
    if problem := vocabulary_problem(pairs, (), vocab_size):
        raise RequestError(400, problem, "logit_bias")
    return pairs


def allowed_token_ids(value, vocab_size: int) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids` checked against the vocabulary; () when absent."""
    if value is None:
        return ()
    try:
        ids = allowed_token_ids_of(value)
    except ValueError as e:
        raise RequestError(400, str(e), "allowed_token_ids") from None
    if problem := vocabulary_problem((), ids, vocab_size):
        raise RequestError(400, problem, "allowed_token_ids")
    return ids


def whole(value) -> int | None:
    """value as an int where it is one, 2.0 included (vLLM's pydantic models take an integral
    float for an integer field); None otherwise (a bool, 2.5, 1e300, a string)."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer() and abs(value) < 2**64:
        return int(value)
    return None


def seed(value) -> int:
    """OpenAI's seeds are signed 64-bit; the engine's generators take them as unsigned."""
    seed = whole(value)
    if seed is None or not -_INT64 <= seed < _INT64:
        raise RequestError(400, f"seed: {value!r} is not a 64-bit integer", "seed")
    return seed % 2**64


def integer(body: dict, name: str, low: int, end: int, default):
    value = body.get(name, default)
    if value is default:
        return value
    number = whole(value)
    if number is None or not low <= number < end:
        raise RequestError(400, f"{name}: {value!r} is not an integer in [{low}, {end - 1}]", name)
    return number


def checked_max_tokens(max_tokens) -> int:
    number = whole(max_tokens)
    if number is None or number < 1:
        raise RequestError(
            400, f"max_tokens: {max_tokens!r} must be a positive integer", "max_tokens"
        )
    return number


def stops(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise RequestError(400, "stop: a string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(400, f"stop: {len(stops)} strings, at most {MAX_STOPS}", "stop")
    return tuple(stops)


def is_token_id(value, vocab_size: int) -> bool:
    return type(value) is int and 0 <= value < vocab_size


def request_id(value) -> str | None:
    """vLLM's `request_id`: a printable string of at most 256 characters, or None."""
    if value is None or (isinstance(value, str) and 0 < len(value) <= 256 and value.isprintable()):
        return value
    raise RequestError(400, "request_id: a string of 1 to 256 printable characters", "request_id")
