"""OpenAI API parity through `//tools:serve` (real prefill and decode servers and the router;
a second router on them with vLLM's hermes tool-call and qwen3 reasoning parsers), driven by the
official `openai` client: content parts and null fields, logprobs (equal to Hugging Face's
log-softmax, the prompt's too: an echo's and vLLM's prompt_logprobs), logit_bias (greedy on
Hugging Face's logits plus the bias), a batch of prompts, echo, n choices from one KV transfer,
JSON Schema and choice constraints, tool calls (named, and auto through the hermes parser),
reasoning split by the qwen3 parser, /tokenize and /detokenize; a bad-input suite where every
answer is a fast 4xx with OpenAI's body; non-streaming clients that time out free their slot."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import MODEL, counter, decode_pool_free, running_router
from tools.launch import start

SERVED = Path(MODEL).name
"""The model's name as `//tools:serve` serves it."""
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`//tools:serve` as a user runs it: (router URL, decode address, decode metrics URL,
    prefill URL)."""
    # The bundled model comes from the conversion cache: seed it with Bazel's converted folder.
    cache = tmp_path_factory.mktemp("cache")
    (cache / SERVED).symlink_to(Path(MODEL).resolve())
    os.environ["TANDEM_CACHE_DIR"] = str(cache)
    proc, m = start(["tools.serve", "--port", "0", "--kv-cache-gb", "0.1"],
                    r"tandem ready: (http://\S+) \(decode metrics: (\S+)\)",
                    timeout=300)  # fmt: skip
    url = m.group(1)
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
        (decode,), (prefill,) = health["decode"], health["prefill"]
        yield url, decode, m.group(2), prefill
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def router(stack):
    return stack[0]


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def test_content_parts_and_unset_fields_sent_as_null(client):
    """What many clients send: content as a list of text parts, every optional field null."""
    plain = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=8,
                                           temperature=0)  # fmt: skip
    parts = [{"type": "text", "text": MESSAGES[0]["content"]}]
    nulls = {"logprobs": None, "top_logprobs": None, "stop": None, "seed": None, "n": None,
             "response_format": None, "tools": None, "user": None}  # fmt: skip
    reply = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0,
        extra_body=nulls,
    )  # fmt: skip
    assert reply.choices[0].message.content == plain.choices[0].message.content


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of Hugging Face's float32 logits at every position of `ids`."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_logprobs_equal_hugging_faces(client, hf_model):
    prompt = [504, 3458, 2767, 28]
    reply = client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = reply.choices[0].logprobs
    generated = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert len(generated) == reply.usage.completion_tokens == 6
    expected = _hf_logprobs(hf_model, prompt + generated)[len(prompt) - 1 : -1]
    for i, token in enumerate(generated):
        top = expected[i].topk(3)
        assert token == int(top.indices[0])  # greedy: the sampled token is the top-1 entry
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i, token]), abs=1e-3)
        assert lp.top_logprobs[i] == pytest.approx(
            {f"token_id:{int(t)}": float(v) for v, t in zip(*top, strict=True)}, abs=1e-3
        )


def test_a_logit_bias_steers_greedy_tokens_as_on_hugging_faces_logits(client, hf_model):
    """Through the prefill (the first token) and the decode (the rest): the greedy tokens of
    Hugging Face's logits plus the bias; logprobs stay the raw ones (vLLM's)."""
    prompt, ids = [504, 3458, 2767, 28], {"return_tokens_as_token_ids": True}
    kwargs = {"model": SERVED, "prompt": prompt, "max_tokens": 6, "temperature": 0,
              "logprobs": 0, "extra_body": ids}  # fmt: skip
    plain = _token_ids(client.completions.create(**kwargs))
    bias = {plain[0]: -100.0, plain[2]: -100.0, 28: 3.0}
    reply = client.completions.create(**kwargs, logit_bias={str(t): b for t, b in bias.items()})
    biased = _token_ids(reply)
    expected, context = [], list(prompt)
    with torch.inference_mode():
        for _ in range(6):
            logits = hf_model(torch.tensor([context])).logits[0, -1].float()
            raw = torch.log_softmax(logits, dim=-1)
            for token, value in bias.items():
                logits[token] += value
            expected.append((int(logits.argmax()), float(raw[logits.argmax()])))
            context.append(expected[-1][0])
    assert biased == [t for t, _ in expected] and biased != plain
    assert reply.choices[0].logprobs.token_logprobs == pytest.approx([lp for _, lp in expected],
                                                                     abs=1e-3)  # fmt: skip


def test_allowed_token_ids_keep_greedy_tokens_among_them_as_on_hugging_faces_logits(
    client, hf_model
):
    """Through the prefill (the first token) and the decode (the rest), vLLM's
    allowed_token_ids: the greedy token among them at each step."""
    prompt, allowed = [504, 3458, 2767, 28], [28, 30, 216, 253, 314]
    extra = {"return_tokens_as_token_ids": True, "allowed_token_ids": allowed}
    reply = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0,
                                      logprobs=0, extra_body=extra)  # fmt: skip
    expected, context = [], list(prompt)
    with torch.inference_mode():
        for _ in range(6):
            logits = hf_model(torch.tensor([context])).logits[0, -1].float()
            context.append(allowed[int(logits[allowed].argmax())])
            expected.append(context[-1])
    assert _token_ids(reply) == expected and len(set(expected)) > 1


def _token_ids(reply) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]


def test_a_batch_of_prompts_answers_as_each_prompt_alone_and_echo_prepends_the_prompt(client):
    prompts = ["The capital of France is", "1, 2, 3,", [504, 3458, 2767, 28]]
    kwargs = {"model": SERVED, "max_tokens": 6, "temperature": 0}
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    texts = [reply.choices[0].text for reply in alone]
    batch = client.completions.create(prompt=prompts[:2], **kwargs)
    assert [(c.index, c.text) for c in batch.choices] == list(enumerate(texts[:2]))
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone[:2])
    streamed = ["", ""]
    for chunk in client.completions.create(prompt=[prompts[2]] * 2, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [texts[2]] * 2
    echoed = client.completions.create(prompt=prompts[0], echo=True, **kwargs)
    assert echoed.choices[0].text == prompts[0] + texts[0]


def test_an_echo_with_logprobs_scores_each_prompt_token_as_hugging_face(client, router, hf_model):
    """lm-evaluation-harness's loglikelihood request (token-id prompts in a batch, echo,
    logprobs 1, max_tokens 1), and max_tokens 0 (the prompt alone), streamed too."""
    prompts = [[504, 3458, 2767, 28, 3838], [30, 216, 34, 28]]
    reply = client.completions.create(model=SERVED, prompt=prompts, max_tokens=1, temperature=0,
                                      logprobs=1, echo=True)  # fmt: skip
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        lp = choice.logprobs
        expected = _hf_logprobs(hf_model, prompt)
        assert len(lp.tokens) == len(prompt) + 1  # and the generated token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for position, token in enumerate(prompt[1:]):
            row = expected[position]
            assert lp.token_logprobs[position + 1] == pytest.approx(float(row[token]), abs=1e-3)
            best = int(row.argmax())
            text = lp.tokens[position + 1]
            expected_top = {text: float(row[token])}
            expected_top.setdefault(_token_text(router, best), float(row[best]))
            assert lp.top_logprobs[position + 1] == pytest.approx(expected_top, abs=1e-3)
        assert choice.text.startswith("".join(lp.tokens[: len(prompt)]))
    alone = client.completions.create(model=SERVED, prompt=prompts[1], max_tokens=0, echo=True,
                                      logprobs=1, temperature=0)  # fmt: skip
    [choice] = alone.choices
    assert choice.logprobs.tokens == reply.choices[1].logprobs.tokens[:-1]
    assert choice.logprobs.token_logprobs == reply.choices[1].logprobs.token_logprobs[:-1]
    assert choice.text == "".join(choice.logprobs.tokens)
    streamed = client.completions.create(model=SERVED, prompt=prompts[1], max_tokens=0, echo=True,
                                         logprobs=1, temperature=0, stream=True)  # fmt: skip
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens


def test_prompt_logprobs_in_vllms_shape_as_hugging_face(client, router, hf_model):
    prompt = [504, 3458, 2767, 28]
    expected = _hf_logprobs(hf_model, prompt)
    kwargs = {"model": SERVED, "max_tokens": 2, "temperature": 0}
    completion = client.completions.create(prompt=prompt, **kwargs,
                                           extra_body={"prompt_logprobs": 2})  # fmt: skip
    chat = client.chat.completions.create(messages=MESSAGES, **kwargs,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    field = completion.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(prompt)
    for position, (token, entry) in enumerate(zip(prompt[1:], field[1:], strict=True)):
        row = expected[position]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=1e-3)
        assert own["rank"] == int((row > row[token]).sum()) + 1
        assert own["decoded_token"] == _token_text(router, token)
        top = [int(t) for t in row.topk(2).indices]
        ranked = {int(k): v["rank"] for k, v in entry.items() if int(k) != token}
        assert ranked == {t: rank for rank, t in enumerate(top, 1) if t != token}
    chat_field = chat.model_extra["prompt_logprobs"]
    assert chat_field[0] is None and all(len(entry) == 1 for entry in chat_field[1:])
    assert "prompt_logprobs" not in client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=1
    ).choices[0].model_extra  # fmt: skip


def test_return_token_ids_as_vllm(client, router):
    """The prompt's ids (those /tokenize gives) and each choice's generated ones (those its
    logprobs name), in a body and in a stream; chat names logprobs' tokens by id too."""
    prompt = "The capital of France is"
    tokens = httpx.post(f"{router}/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    kwargs = {"model": SERVED, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    choice = client.completions.create(prompt=prompt, extra_body=extra, **kwargs).choices[0]
    named = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert choice.model_extra["prompt_token_ids"] == tokens
    assert choice.model_extra["token_ids"] == named and len(named) == 5
    chunks = list(client.completions.create(prompt=prompt, extra_body=extra, stream=True,
                                            **kwargs))  # fmt: skip
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == tokens
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == named
    chat = client.chat.completions.create(messages=MESSAGES, extra_body=extra, **{
        **kwargs, "logprobs": True})  # fmt: skip
    generated = chat.choices[0].model_extra["token_ids"]
    assert [e.token for e in chat.choices[0].logprobs.content] == [
        f"token_id:{t}" for t in generated]  # fmt: skip
    rendered = httpx.post(f"{router}/tokenize", json={"messages": MESSAGES}, timeout=10)
    assert chat.model_extra["prompt_token_ids"] == rendered.json()["tokens"]


def _token_text(router: str, token: int) -> str:
    """The token's text, as /detokenize gives it."""
    reply = httpx.post(f"{router}/detokenize", json={"tokens": [token]}, timeout=10)
    return reply.json()["prompt"]


def test_chat_logprobs_streamed_or_not(client):
    kwargs = {"model": SERVED, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
              "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    tokens = "".join(e.token for e in content)  # the end-of-sequence token's included
    assert tokens.removesuffix("<|im_end|>") == whole.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_n_choices_share_one_kv_transfer_and_sample_with_their_own_seeds(client, stack):
    """n=3 with a seed: one prefill and one KV transfer for all (from the decode server's
    metrics), three different texts (seeds 7, 8, 9), the same again when streamed, and again
    with no temperature sent (the default is 1)."""
    transferred = stack[2]
    kwargs = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 10,
              "temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}  # fmt: skip
    before = counter(transferred, "tandem_decode_transfer_bytes_total")
    client.completions.create(**kwargs)
    one = counter(transferred, "tandem_decode_transfer_bytes_total") - before
    reply = client.completions.create(**kwargs, n=3)
    three = counter(transferred, "tandem_decode_transfer_bytes_total") - before - one
    assert three == one > 0  # the prompt's KV went over once for three choices
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) == 3
    assert reply.usage.completion_tokens == 30  # every choice's
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kwargs, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    # No temperature: OpenAI's 1 (SmolLM2's generation config names none), as vLLM samples it.
    del kwargs["temperature"]
    unset = client.completions.create(**kwargs, n=3)
    assert [c.text for c in unset.choices] == texts


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _text(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(text, finish reason) of a chat, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_parses_and_validates(client, stream):
    text, finish = _text(
        client, stream, model=SERVED, max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Invent a person. Reply in JSON: name, age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": PERSON}},
    )  # fmt: skip
    person = json.loads(text)
    assert set(person) == {"name", "age"} and finish == "stop"
    assert isinstance(person["name"], str) and len(person["name"]) <= 16
    assert type(person["age"]) is int


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_constrains_the_whole_output(client, stream):
    text, finish = _text(
        client, stream, model=SERVED, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    )  # fmt: skip
    assert text in ("yes", "no", "maybe so") and finish == "stop"


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_has_valid_arguments(client, stream):
    kwargs = {"model": SERVED, "messages": ASK, "max_tokens": 32, "temperature": 0,
              "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    if stream:
        calls = [c for chunk in client.chat.completions.create(**kwargs, stream=True)
                 if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]  # fmt: skip
        name = calls[0].function.name
        arguments = "".join(c.function.arguments or "" for c in calls)
    else:
        (call,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)


HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}"\}\}'
    r"\n</tool_call>"
)
THINKING = r"<think>[a-z ]{1,20}</think>[A-Z][a-z ]{1,20}\."


@pytest.fixture(scope="module")
def parsing_client(stack):
    """A second router, on the same servers, with vLLM's hermes tool-call parser and qwen3
    reasoning parser (which takes a chat's text for reasoning until it has seen </think>)."""
    _, decode, _, prefill = stack
    parsers = ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    with running_router([prefill], [decode], "--served-model-name", SERVED, *parsers) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_a_hermes_completion(parsing_client, stream):
    """The output is forced into hermes's format by a regex; the parser finds the call."""
    extra = {"structured_outputs": {"regex": HERMES_CALL},
             "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    kwargs = {"model": SERVED, "messages": ASK, "max_tokens": 96, "temperature": 0,
              "tools": [WEATHER], "extra_body": extra}  # fmt: skip
    if stream:
        chunks = [c for c in parsing_client.chat.completions.create(**kwargs, stream=True)
                  if c.choices]  # fmt: skip
        calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
        name, finish = calls[0].function.name, chunks[-1].choices[0].finish_reason
        arguments = "".join(c.function.arguments or "" for c in calls)
    else:
        choice = parsing_client.chat.completions.create(**kwargs).choices[0]
        (call,) = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
    assert name == "get_weather" and finish == "tool_calls"
    assert set(json.loads(arguments)) == {"city"}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_content(parsing_client, stream):
    kwargs = {"model": SERVED, "messages": MESSAGES, "max_tokens": 48, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": THINKING}}}  # fmt: skip
    if stream:
        chunks = parsing_client.chat.completions.create(**kwargs, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = parsing_client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning, message.content
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert content and content.endswith(".") and "think>" not in content
    # vLLM's include_reasoning false: the same content, the reasoning left out.
    kwargs["extra_body"]["include_reasoning"] = False
    if stream:
        chunks = parsing_client.chat.completions.create(**kwargs, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not any(getattr(d, "reasoning", None) for d in deltas)
        assert "".join(d.content or "" for d in deltas) == content
    else:
        message = parsing_client.chat.completions.create(**kwargs).choices[0].message
        assert message.content == content and getattr(message, "reasoning", None) is None


BAD_INPUT = [
    (b"{not json", 400, None),
    (b"[" * 50000, 400, None),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": "3"}, 400, "logprobs"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1e300}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),  # no tokens: SmolLM2's tokenizer adds no BOS
    ({"prompt": [1] * 9000, "max_tokens": 1}, 400, "max_tokens"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"prompt": "hi", "min_p": 7}, 400, "min_p"),
    ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "seed": -(2**64)}, 400, "seed"),
    ({"prompt": [49152]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "logit_bias": {"49152": 5}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"the": 5}}, 400, "logit_bias"),
    ({"prompt": "hi", "wizardry": 1}, 400, "wizardry"),
    ({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://x/cat.png"}}]}]}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_tokens"),
]  # fmt: skip


def _post_bad(router: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{router}/v1/completions", content=body, timeout=30)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(f"{router}{path}", json={"model": SERVED, **body}, timeout=30)


@pytest.mark.parametrize(("body", "status", "param"), BAD_INPUT)
def test_bad_input_gets_a_4xx_with_openai_error_bodies_fast(router, body, status, param):
    start = time.monotonic()
    reply = _post_bad(router, body)
    assert time.monotonic() - start < 1.0
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"]
    assert error["type"] == "invalid_request_error"


def test_the_stack_serves_normally_after_the_bad_input(router, client):
    for body, status, _ in BAD_INPUT:
        assert _post_bad(router, body).status_code == status
    ok = client.completions.create(model=SERVED, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


def test_non_streaming_clients_that_time_out_free_their_decode_slot(router, stack):
    """A client gives up (its HTTP timeout) on long non-streaming requests: the router aborts
    them, so its in-flight count and the decode pool are back to baseline within 2 s."""
    body = {"model": SERVED, "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{router}/v1/completions", json=body, timeout=1.0)
    assert decode_pool_free(stack[1], within=2.0) is not None
    metrics = httpx.get(f"{router}/metrics").text
    assert "tandem_router_in_flight 0.0" in metrics.splitlines()


def test_tokenize_detokenize_and_the_decode_servers_context(router, stack):
    reply = httpx.post(f"{router}/tokenize", json={"prompt": "Hello world"}).json()
    assert reply["count"] == len(reply["tokens"]) > 0
    again = httpx.post(f"{router}/detokenize", json={"tokens": reply["tokens"]}).json()
    assert again == {"prompt": "Hello world"}
    chat = httpx.post(f"{router}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > reply["count"]
    with grpc.insecure_channel(stack[1]) as channel:
        stats = decode_pb2_grpc.DecodeServiceStub(channel).Stats(decode_pb2.StatsRequest())
    card = httpx.get(f"{router}/v1/models").json()["data"][0]
    assert card["max_model_len"] == reply["max_model_len"] == stats.max_model_len > 0
