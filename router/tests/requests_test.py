"""Request validation, directly: `parse` turns bodies into ApiRequests or refuses them with the
status, message and parameter a client gets; `generation_request` checks the tokenized prompt
against the context."""

from __future__ import annotations

import json

import pytest

from proto.tandem.v1 import decode_pb2
from router.errors import RequestError
from router.requests import (
    MAX_BODY_BYTES,
    Endpoint,
    generation_request,
    parse,
)

MODEL = "tiny"
COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
MESSAGES = [{"role": "user", "content": "Hi"}]


def _parse(endpoint: Endpoint, body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse(endpoint, raw, MODEL)


def _refusal(endpoint: Endpoint, body: dict | bytes) -> RequestError:
    with pytest.raises(RequestError) as refused:
        _parse(endpoint, body)
    return refused.value


def test_a_completion_with_defaults():
    request = _parse(COMPLETIONS, {"model": MODEL, "prompt": "Hello"})
    assert (request.text, request.token_ids, request.messages) == ("Hello", None, None)
    assert request.max_tokens == 16
    assert request.sampling == decode_pb2.SamplingParams()  # nothing set: the server's defaults
    assert (request.min_tokens, request.stop_token_ids, request.ignore_eos) == (0, (), False)
    assert (request.stops, request.stream, request.include_usage) == ((), False, False)


@pytest.mark.parametrize(
    ("prompt", "text", "token_ids"),
    [(["one"], "one", None), ([5, 0, 7], None, [5, 0, 7]), ("", "", None)],
)
def test_completion_prompts(prompt, text, token_ids):
    request = _parse(COMPLETIONS, {"prompt": prompt})
    assert (request.text, request.token_ids) == (text, token_ids)


def test_a_chat_with_every_supported_parameter():
    body = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 9,
        "temperature": 1, "top_p": 0.5, "top_k": 40.0, "seed": 2**63, "min_p": 0.1,
        "repetition_penalty": 1.1, "presence_penalty": -0.5, "frequency_penalty": 0.5,
        "stop": "END", "stop_token_ids": [2], "min_tokens": 3, "ignore_eos": True, "n": 1,
        "stream": True, "stream_options": {"include_usage": True}, "user": "me",
    }  # fmt: skip
    request = _parse(CHAT, body)
    assert request.messages == MESSAGES and request.text is request.token_ids is None
    assert request.max_tokens == 9  # max_completion_tokens wins
    assert request.sampling.top_k == 40 and request.sampling.seed == 2**63
    assert request.sampling.temperature == 1.0 and request.sampling.HasField("presence_penalty")
    assert (request.stops, request.stop_token_ids, request.min_tokens) == (("END",), (2,), 3)
    assert request.ignore_eos and request.stream and request.include_usage


def test_a_chat_without_a_limit_leaves_it_to_the_context():
    assert _parse(CHAT, {"messages": MESSAGES}).max_tokens is None
    assert _parse(COMPLETIONS, {"prompt": "x", "max_tokens": None}).max_tokens is None


@pytest.mark.parametrize(
    ("endpoint", "body", "status", "param", "message"),
    [
        (COMPLETIONS, b"{not json", 400, None, "body: not valid JSON"),
        (COMPLETIONS, b"\xff\xfe", 400, None, "body: not valid JSON"),
        (COMPLETIONS, [1, 2], 400, None, "body: must be a JSON object"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 2, "echo": True}, 400, "echo",
         "unsupported parameter(s): echo, logprobs"),
        (CHAT, {"messages": MESSAGES, "prompt": "x"}, 400, "prompt",
         "unsupported parameter(s): prompt"),
        (COMPLETIONS, {"prompt": "x", "messages": MESSAGES}, 400, "messages",
         "unsupported parameter(s): messages"),
        (COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, None,
         "model 'gpt-9' not found (serving 'tiny')"),
        (COMPLETIONS, {"prompt": "x", "n": 3}, 400, "n", "n: only 1 is supported"),
        (COMPLETIONS, {"prompt": 42}, 400, "prompt",
         "prompt: a string or a non-empty list of token ids"),
        (COMPLETIONS, {}, 400, "prompt", "prompt: a string or a non-empty list of token ids"),
        (COMPLETIONS, {"prompt": []}, 400, "prompt",
         "prompt: a string or a non-empty list of token ids"),
        (COMPLETIONS, {"prompt": [1, True]}, 400, "prompt",
         "prompt: a string or a non-empty list of token ids"),
        (COMPLETIONS, {"prompt": [-1]}, 400, "prompt",
         "prompt: a string or a non-empty list of token ids"),
        (CHAT, {"messages": []}, 400, "messages",
         "messages: a non-empty list of {role, content}"),
        (CHAT, {"messages": [{"role": "user"}]}, 400, "messages",
         "messages: a non-empty list of {role, content}"),
        (CHAT, {"messages": [{"content": "x"}]}, 400, "messages",
         "messages: a non-empty list of {role, content}"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens",
         "max_tokens: -1 must be a positive integer"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens",
         "max_tokens: 'ten' must be a positive integer"),
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 2.0}, 400, "max_tokens",
         "max_tokens: 2.0 must be a positive integer"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature",
         "temperature: 'hot' is not a number"),
        (COMPLETIONS, {"prompt": "x", "top_p": True}, 400, "top_p", "top_p: True is not a number"),
        (COMPLETIONS, {"prompt": "x", "top_k": 1.5}, 400, "top_k",
         "top_k: 1.5 must be a non-negative integer"),
        (COMPLETIONS, {"prompt": "x", "seed": -1}, 400, "seed",
         "seed: -1 must be a non-negative integer"),
        (COMPLETIONS, {"prompt": "x", "seed": 2**64}, 400, "seed",
         f"seed: {2**64} is out of range"),
        (COMPLETIONS, b'{"prompt": "x", "top_k": Infinity}', 400, "top_k",
         "top_k: inf must be a non-negative integer"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": [1.0]}, 400, "stop_token_ids",
         "stop_token_ids: a list of token ids"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": 3}, 400, "stop_token_ids",
         "stop_token_ids: a list of token ids"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens",
         "min_tokens: -1 not in [0, max_tokens]"),
        (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop",
         "stop: a string or a list of non-empty strings"),
        (COMPLETIONS, {"prompt": "x", "stop": ["a", 1]}, 400, "stop",
         "stop: a string or a list of non-empty strings"),
        (COMPLETIONS, {"prompt": "x", "stream_options": "yes"}, 400, "stream_options",
         "stream_options: must be an object"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_naming_what_is_wrong(endpoint, body, status, param, message):
    refused = _refusal(endpoint, body)
    assert (refused.status, refused.param, str(refused)) == (status, param, message)


def test_an_oversized_body_is_a_413():
    refused = _refusal(COMPLETIONS, b" " * (MAX_BODY_BYTES + 1))
    assert refused.status == 413 and str(refused).startswith(f"body: {MAX_BODY_BYTES + 1} bytes")


def test_the_first_problem_is_reported():
    """Checks run in a fixed order: the body as a whole, then the prompt, then parameters."""
    body = {"prompt": 42, "temperature": "hot", "n": 2}
    assert _refusal(COMPLETIONS, body).param == "n"
    assert _refusal(COMPLETIONS, {"prompt": 42, "temperature": "hot"}).param == "prompt"


def test_a_generation_request_carries_every_checked_field():
    body = {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [9],
            "ignore_eos": True, "seed": 3}  # fmt: skip
    generation = generation_request(_parse(COMPLETIONS, body), [1, 2], max_model_len=6)
    assert generation.prompt_ids == [1, 2] and generation.max_tokens == 4
    assert (generation.min_tokens, generation.stop_token_ids) == (2, (9,))
    assert generation.ignore_eos and generation.sampling.seed == 3


def test_no_limit_means_the_rest_of_the_context():
    request = _parse(CHAT, {"messages": MESSAGES})
    assert generation_request(request, [1, 2, 3], max_model_len=10).max_tokens == 7


@pytest.mark.parametrize(
    ("body", "prompt_len", "param", "message"),
    [
        ({"max_tokens": 8}, 3, "max_tokens",
         "prompt of 3 tokens + max_tokens 8 exceeds the context length 10"),
        ({"max_tokens": None}, 10, "max_tokens", "max_tokens: 0 must be a positive integer"),
        ({"max_tokens": None}, 12, "max_tokens", "max_tokens: -2 must be a positive integer"),
        ({"max_tokens": 2, "min_tokens": 3}, 3, "min_tokens",
         "min_tokens: 3 not in [0, max_tokens]"),
    ],
)  # fmt: skip
def test_prompts_that_do_not_fit_the_context_are_refused(body, prompt_len, param, message):
    request = _parse(COMPLETIONS, {"prompt": "x", **body})
    with pytest.raises(RequestError) as refused:
        generation_request(request, [1] * prompt_len, max_model_len=10)
    assert (refused.value.status, refused.value.param, str(refused.value)) == (400, param, message)
