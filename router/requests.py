"""Every check on a /v1/completions or /v1/chat/completions body, in two pure functions:

  raw body --parse--> ApiRequest --(tokenize the prompt)--> generation_request --> GenerationRequest

`parse` checks all that does not depend on the prompt's token count; `generation_request` checks
the rest (the context length) once the prompt is tokenized. Both raise RequestError with the
HTTP status, a message and the offending parameter. Parameters the stack cannot honour are
refused by name, never dropped.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from proto.tandem.v1 import decode_pb2
from router.errors import RequestError
from router.generation import GenerationRequest

MAX_BODY_BYTES = 8 * 1024 * 1024
SAMPLING = tuple(field.name for field in decode_pb2.SamplingParams.DESCRIPTOR.fields)
"""The sampling fields a request may set: tandem.v1.SamplingParams' (the same names as the
engine's SamplingParams, which decode/tests/service_test.py checks)."""
_INTEGERS = ("top_k", "seed")
_COMMON = {"model", "max_tokens", "stop", "stop_token_ids", "stream", "stream_options", "n",
           "ignore_eos", "min_tokens", "user", *SAMPLING}  # fmt: skip
_TOKEN_ID_END = 2**32  # token ids travel as uint32


class Endpoint(enum.Enum):
    """Which API a request came in on; the value is its response's `object`."""

    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self is Endpoint.CHAT else "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self is Endpoint.CHAT else "cmpl"

    @property
    def parameters(self) -> frozenset[str]:
        extra = {"messages", "max_completion_tokens"} if self is Endpoint.CHAT else {"prompt"}
        return frozenset(_COMMON | extra)


@dataclass(frozen=True)
class ApiRequest:
    """A body that passed `parse`. Exactly one of `text`, `token_ids` and `messages` is set."""

    endpoint: Endpoint
    text: str | None
    """Completions: a prompt to tokenize."""
    token_ids: list[int] | None
    """Completions: a prompt given as token ids."""
    messages: list[dict] | None
    """Chat: the conversation, each message a dict with `role` and a string `content`."""
    max_tokens: int | None
    """At least 1; None: whatever the context leaves after the prompt."""
    sampling: decode_pb2.SamplingParams
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stops: tuple[str, ...]
    """Stop strings, none empty."""
    stream: bool
    include_usage: bool
    """Streaming: end with a chunk that carries the usage."""


def parse(endpoint: Endpoint, raw: bytes, model: str) -> ApiRequest:
    """Checks a raw body sent to `endpoint` of a router serving `model`."""
    body = _json_object(raw)
    unknown = sorted(set(body) - endpoint.parameters)
    if unknown:
        raise RequestError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    if body.get("model", model) != model:
        raise RequestError(404, f"model {body['model']!r} not found (serving {model!r})")
    if body.get("n", 1) != 1:
        raise RequestError(400, "n: only 1 is supported", "n")
    text = token_ids = messages = None
    if endpoint is Endpoint.CHAT:
        messages = _messages(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        text, token_ids = _prompt(body.get("prompt"))
        max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None:
        _check_max_tokens(max_tokens)
    sampling = _sampling(body)
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(_is_token_id(t) for t in stop_ids)):
        raise RequestError(400, "stop_token_ids: a list of token ids", "stop_token_ids")
    min_tokens = body.get("min_tokens", 0)
    if type(min_tokens) is not int or min_tokens < 0:
        raise RequestError(400, f"min_tokens: {min_tokens!r} not in [0, max_tokens]", "min_tokens")
    stops = _stops(body.get("stop"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options: must be an object", "stream_options")
    return ApiRequest(
        endpoint=endpoint,
        text=text,
        token_ids=token_ids,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        min_tokens=min_tokens,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stops=stops,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
    )


def generation_request(
    request: ApiRequest, prompt_ids: list[int], max_model_len: int
) -> GenerationRequest:
    """The orchestrator's request, once the prompt is `prompt_ids`: checks that the prompt and
    max_tokens fit `max_model_len`."""
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
        _check_max_tokens(max_tokens)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            400,
            f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds the context "
            f"length {max_model_len}",
            "max_tokens",
        )
    if request.min_tokens > max_tokens:
        raise RequestError(
            400, f"min_tokens: {request.min_tokens!r} not in [0, max_tokens]", "min_tokens"
        )
    return GenerationRequest(
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        sampling=request.sampling,
        min_tokens=request.min_tokens,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
    )


def _json_object(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"body: {len(raw)} bytes, at most {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        raise RequestError(400, "body: not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "body: must be a JSON object")
    return body


def _prompt(prompt) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return None, prompt
    raise RequestError(400, "prompt: a string or a non-empty list of token ids", "prompt")


def _messages(messages) -> list[dict]:
    if not (isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
        for m in messages
    )):  # fmt: skip
        raise RequestError(400, "messages: a non-empty list of {role, content}", "messages")
    return messages


def _check_max_tokens(max_tokens) -> None:
    if type(max_tokens) is not int or max_tokens < 1:
        raise RequestError(
            400, f"max_tokens: {max_tokens!r} must be a positive integer", "max_tokens"
        )


def _sampling(body: dict) -> decode_pb2.SamplingParams:
    """The sampling fields the client set; unset ones stay unset (the decode server's
    defaults)."""
    sampling = decode_pb2.SamplingParams()
    for name in SAMPLING:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(400, f"{name}: {value!r} is not a number", name)
        if name in _INTEGERS:
            if not (isinstance(value, int) or value.is_integer()) or value < 0:
                raise RequestError(400, f"{name}: {value!r} must be a non-negative integer", name)
            value = int(value)
        try:
            setattr(sampling, name, value if name in _INTEGERS else float(value))
        except (ValueError, OverflowError):  # past the field's range (top_k: uint32, ...)
            raise RequestError(400, f"{name}: {value!r} is out of range", name) from None
    return sampling


def _stops(stop) -> tuple[str, ...]:
    stops = stop or []
    stops = [stops] if isinstance(stops, str) else stops
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise RequestError(400, "stop: a string or a list of non-empty strings", "stop")
    return tuple(stops)


def _is_token_id(value) -> bool:
    return type(value) is int and 0 <= value < _TOKEN_ID_END
