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
    ServedModel,
    generation_request,
    parse,
)
from router.structured import prefill_fields

MODEL = ServedModel("tiny", max_model_len=64, vocab_size=1000)
COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
MESSAGES = [{"role": "user", "content": "Hi"}]


def _parse(endpoint: Endpoint, body: dict | bytes, model: ServedModel = MODEL):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse(endpoint, raw, model)


PROMPT_FORMS = "prompt: a string, a non-empty list of token ids below 1000, or a list of either"
SURROGATE = "body: a string holds an unpaired UTF-16 surrogate (not Unicode)"


def test_escaped_surrogate_pairs_are_text():
    """A JSON-escaped pair is one character (an emoji here), not a refusal."""
    assert _parse(COMPLETIONS, b'{"prompt": "hi \\ud83d\\ude00"}').text == "hi \U0001f600"


def _refusal(endpoint: Endpoint, body: dict | bytes) -> RequestError:
    with pytest.raises(RequestError) as refused:
        _parse(endpoint, body)
    return refused.value


def test_a_completion_with_defaults():
    request = _parse(COMPLETIONS, {"model": "tiny", "prompt": "Hello"})
    assert (request.text, request.token_ids, request.messages) == ("Hello", None, None)
    assert request.max_tokens == 16
    # Nothing set: OpenAI's temperature (the served model has no generation config), the
    # engine's neutral defaults for the rest.
    assert request.sampling == decode_pb2.SamplingParams(temperature=1.0)
    assert (request.min_tokens, request.stop_token_ids, request.ignore_eos) == (0, (), False)
    assert (request.stops, request.stream, request.include_usage) == ((), False, False)
    assert request.skip_special_tokens and not request.include_stop_str_in_output


def test_a_batch_of_prompts_is_one_request_a_prompt():
    request = _parse(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2, "temperature": 1})
    assert (request.text, request.other_prompts) == ("a", (("b", None), ("c", None)))
    parts = request.one_per_prompt()
    assert [(p.text, p.token_ids, p.other_prompts, p.n) for p in parts] == [
        ("a", None, (), 2),
        ("b", None, (), 2),
        ("c", None, (), 2),
    ]
    request = _parse(COMPLETIONS, {"prompt": [[1, 2], [3]]})
    assert [p.token_ids for p in request.one_per_prompt()] == [[1, 2], [3]]
    assert _parse(COMPLETIONS, {"prompt": ["a"]}).one_per_prompt()[0].text == "a"


@pytest.mark.parametrize(
    ("prompt", "text", "token_ids"),
    [(["one"], "one", None), ([5, 0, 7], None, [5, 0, 7]), ([[5, 7]], None, [5, 7]),
     ("", "", None)],
)  # fmt: skip
def test_completion_prompts(prompt, text, token_ids):
    request = _parse(COMPLETIONS, {"prompt": prompt})
    assert (request.text, request.token_ids) == (text, token_ids)


def test_a_chat_with_every_supported_parameter():
    body = {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 9,
        "temperature": 1, "top_p": 0.5, "top_k": 40.0, "seed": -1, "min_p": 0.1,
        "repetition_penalty": 1.1, "presence_penalty": -0.5, "frequency_penalty": 0.5,
        "stop": "END", "stop_token_ids": [2], "min_tokens": 3, "ignore_eos": True, "n": 2,
        "stream": True, "stream_options": {"include_usage": True}, "user": "me",
        "logprobs": True, "top_logprobs": 3, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "metadata": {"k": "v"}, "store": False,
        "parallel_tool_calls": True, "response_format": {"type": "text"}, "tool_choice": "none",
    }  # fmt: skip
    request = _parse(CHAT, body)
    assert request.messages == MESSAGES and request.text is request.token_ids is None
    assert request.max_tokens == 9  # max_completion_tokens wins
    assert request.sampling.top_k == 40 and request.sampling.seed == 2**64 - 1
    assert request.sampling.temperature == 1.0 and request.sampling.HasField("presence_penalty")
    assert request.sampling.logprobs == 3
    assert (request.stops, request.stop_token_ids, request.min_tokens) == (("END",), (2,), 3)
    assert request.ignore_eos and request.stream and request.include_usage
    assert request.include_stop_str_in_output and not request.skip_special_tokens
    assert request.n == 2 and generation_request(request, [1, 2], 64).n == 2


def test_null_means_absent():
    body = {"prompt": "x", "logprobs": None, "temperature": None, "stop": None, "n": None,
            "seed": None, "stream": None, "stream_options": None, "user": None}  # fmt: skip
    request = _parse(COMPLETIONS, body)
    assert request.sampling == decode_pb2.SamplingParams(temperature=1.0) and not request.stream


@pytest.mark.parametrize(
    ("endpoint", "body", "logprobs"),
    [(CHAT, {"logprobs": True}, 0), (CHAT, {"logprobs": False}, None),
     (CHAT, {"logprobs": True, "top_logprobs": 20}, 20), (COMPLETIONS, {"logprobs": 0}, 0),
     (COMPLETIONS, {"logprobs": 5}, 5)],
)  # fmt: skip
def test_logprobs_in_either_apis_shape(endpoint, body, logprobs):
    prompt = {"messages": MESSAGES} if endpoint is CHAT else {"prompt": "x"}
    sampling = _parse(endpoint, {**prompt, **body}).sampling
    assert (sampling.logprobs if sampling.HasField("logprobs") else None) == logprobs


@pytest.mark.parametrize(
    ("endpoint", "body", "prompt_logprobs"),
    [(CHAT, {"prompt_logprobs": 3}, 3), (COMPLETIONS, {"prompt_logprobs": 0}, 0),
     (COMPLETIONS, {"echo": True, "logprobs": 2}, 2),  # vLLM's: echo takes logprobs' count
     (COMPLETIONS, {"echo": True, "logprobs": 2, "prompt_logprobs": 4}, 4),
     (COMPLETIONS, {"echo": True}, None), (COMPLETIONS, {"logprobs": 2}, None),
     (COMPLETIONS, {"echo": True, "logprobs": 1, "stream": True}, 1),  # as the echo's
     (CHAT, {"echo": True, "logprobs": True, "top_logprobs": 3}, 3),  # chat's: in the body
     (CHAT, {"echo": True, "logprobs": True}, None),
     (CHAT, {"echo": True, "logprobs": True, "top_logprobs": 3, "stream": True}, None),
     (COMPLETIONS, {"prompt_logprobs": 0, "stream": True}, None)],  # nothing to report
)  # fmt: skip
def test_prompt_logprobs_asked_or_taken_from_an_echo(endpoint, body, prompt_logprobs):
    prompt = {"messages": MESSAGES} if endpoint is CHAT else {"prompt": "x"}
    sampling = _parse(endpoint, {**prompt, **body}).sampling
    asked = sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None
    assert asked == prompt_logprobs


def test_special_tokens_are_added_to_a_text_not_to_a_chat_unless_asked():
    assert _parse(COMPLETIONS, {"prompt": "x"}).add_special_tokens
    assert not _parse(COMPLETIONS, {"prompt": "x", "add_special_tokens": False}).add_special_tokens
    assert not _parse(CHAT, {"messages": MESSAGES}).add_special_tokens
    assert _parse(CHAT, {"messages": MESSAGES, "add_special_tokens": True}).add_special_tokens


def test_an_echo_of_no_tokens_is_the_prompt_alone_of_one_token_generated():
    request = _parse(COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": 0})
    assert request.prompt_only and request.max_tokens == 1
    assert not _parse(COMPLETIONS, {"prompt": "x", "echo": True}).prompt_only


def test_unset_fields_take_the_models_defaults_and_set_ones_stay():
    model = ServedModel("tiny", 64, 1000, sampling_defaults={"temperature": 0.6, "top_k": 20})
    body = {"prompt": "x", "n": 2}  # sampled at the model's temperature: n needs no more
    assert _parse(COMPLETIONS, body, model).sampling == decode_pb2.SamplingParams(
        temperature=0.6, top_k=20)  # fmt: skip
    body = {"prompt": "x", "temperature": 0, "top_k": -1}
    assert _parse(COMPLETIONS, body, model).sampling == decode_pb2.SamplingParams(
        temperature=0.0, top_k=0)  # fmt: skip


def test_allowed_token_ids_sorted_without_repeats():
    request = _parse(COMPLETIONS, {"prompt": "x", "allowed_token_ids": [9, 3, 9]})
    assert list(request.sampling.allowed_token_ids) == [3, 9]


def test_logit_bias_by_token_id_clamped_as_vllm():
    body = {"prompt": "x", "logit_bias": {"999": 1.5, "0": -250, "17": 100.5}}
    assert dict(_parse(COMPLETIONS, body).sampling.logit_bias) == {999: 1.5, 0: -100.0, 17: 100.0}
    for empty in ({}, None):
        sampling = _parse(CHAT, {"messages": MESSAGES, "logit_bias": empty}).sampling
        assert sampling == decode_pb2.SamplingParams(temperature=1.0)


def test_integral_floats_are_integers_as_vllms_pydantic_models_take_them():
    body = {"prompt": "x", "max_tokens": 4.0, "n": 2.0, "temperature": 1, "min_tokens": 1.0,
            "logprobs": 3.0, "seed": 7.0, "stop_token_ids": [2]}  # fmt: skip
    request = _parse(COMPLETIONS, body)
    assert (request.max_tokens, request.n, request.min_tokens) == (4, 2, 1)
    assert type(request.max_tokens) is int and type(request.n) is int
    assert (request.sampling.logprobs, request.sampling.seed) == (3, 7)


def test_top_k_minus_one_is_no_limit():
    assert _parse(COMPLETIONS, {"prompt": "x", "top_k": -1}).sampling.top_k == 0


def test_a_chat_without_a_limit_leaves_it_to_the_context():
    assert _parse(CHAT, {"messages": MESSAGES}).max_tokens is None
    assert _parse(COMPLETIONS, {"prompt": "x", "max_tokens": None}).max_tokens == 16


ONE_PART = [{"type": "text", "text": "Hi"}]


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "user", "content": ONE_PART}], [{"role": "user", "content": "Hi"}]),
        ([{"role": "user", "content": [*ONE_PART, {"type": "text", "text": "there"}]}],
         [{"role": "user", "content": "Hi\nthere"}]),
        ([{"role": "developer", "content": "Be brief.", "name": "ops"}],
         [{"role": "developer", "content": "Be brief.", "name": "ops"}]),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
           "function": {"name": "f", "arguments": '{"x": 1}'}}]},
          {"role": "tool", "content": "2", "tool_call_id": "c1"}],
         [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
           "function": {"name": "f", "arguments": {"x": 1}}}]},
          {"role": "tool", "content": "2", "tool_call_id": "c1"}]),
    ],
)  # fmt: skip
def test_chat_messages_as_clients_send_them(messages, expected):
    assert _parse(CHAT, {"messages": messages}).messages == expected


@pytest.mark.parametrize(
    ("endpoint", "body", "status", "param", "message"),
    [
        (COMPLETIONS, b"{not json", 400, None, "body: not valid JSON"),
        (COMPLETIONS, b"\xff\xfe", 400, None, "body: not valid JSON"),
        (COMPLETIONS, b"[" * 100000, 400, None, "body: not valid JSON"),
        (COMPLETIONS, [1, 2], 400, None, "body: must be a JSON object"),
        (COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, None, SURROGATE),
        (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
         b'"\\udfff"}]}]}', 400, None, SURROGATE),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud83d"]}', 400,
         None, SURROGATE),
        (COMPLETIONS, {"prompt": "x", "wizardry": 2, "ghost": 1}, 400, "ghost",
         "unsupported parameter(s): ghost, wizardry"),
        (CHAT, {"messages": MESSAGES, "prompt": "x"}, 400, "prompt",
         "unsupported parameter(s): prompt"),
        (COMPLETIONS, {"prompt": "x", "messages": MESSAGES}, 400, "messages",
         "unsupported parameter(s): messages"),
        (COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model",
         "model 'gpt-9' not found (serving 'tiny')"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", "n: 0 is not an integer in [1, 128]"),
        (CHAT, {"messages": MESSAGES, "n": 129}, 400, "n",
         "n: 129 is not an integer in [1, 128]"),
        (COMPLETIONS, {"prompt": "x", "n": True}, 400, "n",
         "n: True is not an integer in [1, 128]"),
        (COMPLETIONS, {"prompt": "x", "n": 2, "temperature": 0}, 400, "n",
         "n: 2 choices need sampling (a temperature above 0); greedy ones would all be the same"),
        (COMPLETIONS, {"prompt": "x", "best_of": 2}, 400, "best_of",
         "best_of: 2 is not supported yet"),
        (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
         "prompt_logprobs", "prompt_logprobs: not available when stream is true"),
        (CHAT, {"messages": MESSAGES, "prompt_logprobs": 21}, 400, "prompt_logprobs",
         "prompt_logprobs: 21 is not an integer in [0, 20]"),
        (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs",
         "prompt_logprobs: -1 is not an integer in [0, 20]"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
         "max_tokens: 0 must be a positive integer"),
        (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [5, 1000]}, 400, "allowed_token_ids",
         "allowed_token_ids: token id 1000 is outside the vocabulary [0, 1000)"),
        (CHAT, {"messages": MESSAGES, "allowed_token_ids": []}, 400, "allowed_token_ids",
         "allowed_token_ids: empty; leave it out to allow every token"),
        (COMPLETIONS, {"prompt": "x", "request_id": ""}, 400, "request_id",
         "request_id: a string of 1 to 256 printable characters"),
        (CHAT, {"messages": MESSAGES, "request_id": 7}, 400, "request_id",
         "request_id: a string of 1 to 256 printable characters"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"1000": 1}}, 400, "logit_bias",
         "logit_bias: token id 1000 is outside the vocabulary [0, 1000)"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"a": 1}}, 400, "logit_bias",
         "logit_bias: key 'a' is not a token id (an integer, at least 0)"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"5": "x"}}, 400, "logit_bias",
         "logit_bias: the bias of '5', 'x', is not a number"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": [[5, 1]]}, 400, "logit_bias",
         "logit_bias: must be an object of token ids to biases"),
        (CHAT, {"messages": MESSAGES, "response_format": {"type": "xml"}}, 400,
         "response_format",
         "response_format: type 'xml' is not one of text, json_object, json_schema"),
        (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
         "response_format",
         "response_format.json_schema.schema: a JSON Schema object is required"),
        (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format",
         'response_format: json_schema: does not compile: Unsupported type "nonsense"'),
        (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "("}}, 400,
         "structured_outputs", "structured_outputs: regex: does not compile: Regex parsing error "
         "at position 2: The parenthesis is not closed."),
        (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
         400, "structured_outputs", "structured_outputs: give exactly one of json, json_object, "
         "regex, grammar, choice (got 2)"),
        (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_object"},
                "guided_regex": "a+"}, 400, "guided_regex", "guided_regex: one constraint per "
         "request (also given: response_format)"),
        (COMPLETIONS, {"prompt": "x", "guided_choice": []}, 400, "guided_choice",
         "guided_choice: choice: must be a non-empty list of strings"),
        (COMPLETIONS, {"prompt": "x", "guided_json": "{oops"}, 400, "guided_json",
         "guided_json: json: the JSON Schema is not JSON"),
        (COMPLETIONS, {"prompt": "x", "structured_outputs": {"grammar": "root ::= "}}, 400,
         "structured_outputs", "structured_outputs: grammar: does not compile: EBNF parser error "
         "at line 1, column 10: Expect element, but got"),
        (COMPLETIONS, {"prompt": 42}, 400, "prompt",
         PROMPT_FORMS),
        (COMPLETIONS, {}, 400, "prompt",
         PROMPT_FORMS),
        (COMPLETIONS, {"prompt": []}, 400, "prompt",
         PROMPT_FORMS),
        (COMPLETIONS, {"prompt": [1, True]}, 400, "prompt",
         PROMPT_FORMS),
        (COMPLETIONS, {"prompt": [-1]}, 400, "prompt",
         PROMPT_FORMS),
        (COMPLETIONS, {"prompt": [1000]}, 400, "prompt",
         PROMPT_FORMS),
        (COMPLETIONS, {"prompt": ["a", [1]]}, 400, "prompt", PROMPT_FORMS),
        (COMPLETIONS, {"prompt": [[1], []]}, 400, "prompt", PROMPT_FORMS),
        (COMPLETIONS, {"prompt": [[1], [1000]]}, 400, "prompt", PROMPT_FORMS),
        (COMPLETIONS, {"prompt": ["a"] * 65, "n": 2, "temperature": 1}, 400, "prompt",
         "prompt: 65 prompts of 2 choices each, more than 128 choices"),
        (CHAT, {"messages": []}, 400, "messages", "messages: a non-empty list of messages"),
        (CHAT, {"messages": [{"role": "user"}]}, 400, "messages",
         "messages[0].content: missing (a string or a list of text parts)"),
        (CHAT, {"messages": [{"content": "x"}]}, 400, "messages",
         "messages[0].role: None is not one of system, developer, user, assistant, tool"),
        (CHAT, {"messages": [*MESSAGES, {"role": "wizard", "content": "x"}]}, 400, "messages",
         "messages[1].role: 'wizard' is not one of system, developer, user, assistant, tool"),
        (CHAT, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}, 400, "messages",
         "messages[0].content[0]: 'image_url' parts are not supported: this model takes text only"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages",
         'messages[0].content[0]: not a text part ({"type": "text", "text": "..."})'),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages",
         "messages[0].content: a string or a list of text parts"),
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
            "arguments": "{oops"}}]}]}, 400, "messages",
         "messages[0].tool_calls[0].function.arguments: not JSON"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens",
         "max_tokens: -1 must be a positive integer"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens",
         "max_tokens: 'ten' must be a positive integer"),
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 2.5}, 400, "max_tokens",
         "max_tokens: 2.5 must be a positive integer"),
        (COMPLETIONS, {"prompt": "x", "n": 1.5}, 400, "n", "n: 1.5 is not an integer in [1, 128]"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 1e300}, 400, "max_tokens",
         "max_tokens: 1e+300 must be a positive integer"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature",
         "temperature: 'hot' is not a number"),
        (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature",
         "temperature: -1 is not in [0, 2]"),
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p: 0 is not in (0, 1]"),
        (COMPLETIONS, {"prompt": "x", "top_p": 2}, 400, "top_p", "top_p: 2 is not in (0, 1]"),
        (COMPLETIONS, {"prompt": "x", "top_p": True}, 400, "top_p", "top_p: True is not a number"),
        (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, 400, "min_p", "min_p: 1.5 is not in [0, 1]"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty",
         "presence_penalty: 3 is not in [-2, 2]"),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty",
         "repetition_penalty: 0 is not in (0, 100]"),
        (COMPLETIONS, {"prompt": "x", "top_k": 1.5}, 400, "top_k", "top_k: 1.5 is not an integer"),
        (COMPLETIONS, {"prompt": "x", "top_k": -2}, 400, "top_k",
         "top_k: -2 is not 0 (no limit) or more"),
        (COMPLETIONS, {"prompt": "x", "seed": 2**70}, 400, "seed",
         f"seed: {2**70} is not a 64-bit integer"),
        (COMPLETIONS, {"prompt": "x", "seed": 1.5}, 400, "seed",
         "seed: 1.5 is not a 64-bit integer"),
        (COMPLETIONS, b'{"prompt": "x", "top_k": Infinity}', 400, "top_k",
         "top_k: inf is not an integer"),
        (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature",
         "temperature: nan is not a finite number"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs",
         "logprobs: 21 is not an integer in [0, 20]"),
        (COMPLETIONS, {"prompt": "x", "logprobs": True}, 400, "logprobs",
         "logprobs: True is not an integer in [0, 20]"),
        (CHAT, {"messages": MESSAGES, "logprobs": 1}, 400, "logprobs",
         "logprobs: 1 is not true or false"),
        (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs",
         "top_logprobs: needs logprobs: true"),
        (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
         "top_logprobs: 21 is not an integer in [0, 20]"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": [1.0]}, 400, "stop_token_ids",
         "stop_token_ids: a list of token ids below 1000"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": [5000]}, 400, "stop_token_ids",
         "stop_token_ids: a list of token ids below 1000"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": 3}, 400, "stop_token_ids",
         "stop_token_ids: a list of token ids below 1000"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens",
         "min_tokens: -1 is not an integer in [0, 4294967295]"),
        (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop",
         "stop: a string or a list of non-empty strings"),
        (COMPLETIONS, {"prompt": "x", "stop": ["a", 1]}, 400, "stop",
         "stop: a string or a list of non-empty strings"),
        (COMPLETIONS, {"prompt": "x", "stop": ["s"] * 5}, 400, "stop",
         "stop: 5 strings, at most 4"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream",
         "stream: 'yes' is not true or false"),
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
    body = {"prompt": 42, "temperature": "hot", "best_of": 2}
    assert _refusal(COMPLETIONS, body).param == "best_of"  # a feature not served yet, first
    assert _refusal(COMPLETIONS, {"prompt": 42, "temperature": "hot"}).param == "prompt"


def test_a_generation_request_carries_every_checked_field():
    body = {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [9],
            "ignore_eos": True, "seed": 3}  # fmt: skip
    generation = generation_request(_parse(COMPLETIONS, body), [1, 2], max_model_len=6)
    assert generation.prompt_ids == [1, 2] and generation.max_tokens == 4
    assert (generation.min_tokens, generation.stop_token_ids) == (2, (9,))
    assert generation.ignore_eos and generation.sampling.seed == 3


def test_a_prompt_of_no_tokens_is_refused_naming_it():
    with pytest.raises(RequestError, match=r"^prompt: no tokens") as refused:
        generation_request(_parse(COMPLETIONS, {"prompt": ""}), [], max_model_len=10)
    assert refused.value.param == "prompt"


def test_no_limit_means_the_rest_of_the_context():
    request = _parse(CHAT, {"messages": MESSAGES})
    assert generation_request(request, [1, 2, 3], max_model_len=10).max_tokens == 7


@pytest.mark.parametrize(
    ("body", "prompt_len", "param", "message"),
    [
        ({"max_tokens": 8}, 3, "max_tokens",
         "prompt of 3 tokens + max_tokens 8 exceeds the context length 10"),
        ({"max_tokens": 8}, 12, "max_tokens",
         "prompt of 12 tokens + max_tokens 8 exceeds the context length 10"),
        ({"max_tokens": 2, "min_tokens": 3}, 3, "min_tokens",
         "min_tokens: 3 not in [0, max_tokens]"),
    ],
)  # fmt: skip
def test_prompts_that_do_not_fit_the_context_are_refused(body, prompt_len, param, message):
    request = _parse(COMPLETIONS, {"prompt": "x", **body})
    with pytest.raises(RequestError) as refused:
        generation_request(request, [1] * prompt_len, max_model_len=10)
    assert (refused.value.status, refused.value.param, str(refused.value)) == (400, param, message)


@pytest.mark.parametrize("prompt_len", [10, 12])
def test_a_chat_that_fills_the_context_is_refused(prompt_len):
    request = _parse(CHAT, {"messages": MESSAGES})
    with pytest.raises(RequestError) as refused:
        generation_request(request, [1] * prompt_len, max_model_len=10)
    assert str(refused.value) == (
        f"prompt of {prompt_len} tokens leaves no room in the context length 10"
    )


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s",
          "schema": SCHEMA, "strict": True}}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"choice": ["yes", 'say "no"']}}, "grammar",
         'root ::= "yes" | "say \\"no\\""'),
        ({"guided_regex": "(yes|no)"}, "regex", "(yes|no)"),
        ({"guided_grammar": 'root ::= "a"+'}, "grammar", 'root ::= "a"+'),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)  # fmt: skip
def test_structured_outputs_in_every_shape_become_one_constraint(fields, kind, value):
    request = _parse(CHAT, {"messages": MESSAGES, **fields})
    if kind is None:
        assert request.structured is None
        return
    assert request.structured.WhichOneof("kind") == kind
    assert getattr(request.structured, kind) == value
    assert generation_request(request, [1], max_model_len=10).structured == request.structured


def test_the_prefill_gets_the_constraint_in_vllms_field():
    body = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    request = _parse(COMPLETIONS, {"prompt": "x", **body})
    assert request.structured.compact_whitespace
    assert prefill_fields(request.structured) == {
        "structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}
    }


def test_chat_template_arguments_in_vllms_names():
    assert _parse(CHAT, {"messages": MESSAGES}).template == {
        "add_generation_prompt": True, "continue_final_message": False}  # fmt: skip
    body = {"messages": MESSAGES, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "low"}  # fmt: skip
    assert _parse(CHAT, body).template == {
        "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": False},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"continue_final_message": True}, "continue_final_message"),
     ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
     ({"reasoning_effort": "extreme"}, "reasoning_effort"),
     ({"add_generation_prompt": "yes"}, "add_generation_prompt")],
)  # fmt: skip
def test_bad_chat_template_arguments(fields, param):
    assert _refusal(CHAT, {"messages": MESSAGES, **fields}).param == param
