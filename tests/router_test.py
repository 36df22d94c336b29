"""The router in front of real prefill and decode servers, driven by the official `openai`
client: chat and completions, streaming and not, stop strings, usage; greedy text equals
Hugging Face's; metrics, request ids, the API key, the queue limit, the tokenizer check. The
OpenAI features beyond these are in openai_parity_test.py."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.servers import MODEL, running_backends, running_router, start_router

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def backends():
    with running_backends() as backends:
        yield backends


@pytest.fixture(scope="module")
def router(backends):
    with running_router(*backends) as url:
        yield url


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_chat_text() -> str:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_greedy_equals_hugging_face(client, hf_chat_text):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == hf_chat_text
    assert reply.usage.completion_tokens <= NEW_TOKENS and reply.usage.prompt_tokens > 0


def test_streaming_chat_with_usage_equals_non_streaming(client, hf_chat_text):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hf_chat_text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completions_with_token_ids_and_stop_string(client):
    whole = client.completions.create(
        model=MODEL, prompt=[504, 3458, 2767, 28], max_tokens=NEW_TOKENS, temperature=0
    )
    text = whole.choices[0].text
    assert whole.choices[0].finish_reason == "length" and len(text) > 4
    stop = text[3:6]
    cut = client.completions.create(
        model=MODEL, prompt=[504, 3458, 2767, 28], max_tokens=NEW_TOKENS, temperature=0,
        stop=[stop],
    )  # fmt: skip
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_oversized_body_is_refused(router):
    reply = httpx.post(f"{router}/v1/completions", timeout=30,
                       content=b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}')  # fmt: skip
    assert reply.status_code == 413


def test_models_and_health(router):
    assert httpx.get(f"{router}/v1/models").json()["data"][0]["id"] == MODEL
    health = httpx.get(f"{router}/health").json()
    assert health["status"] == "ok"
    assert health["tokenizer"] == {"source": "router", "parity": "ok", "segmented": True}
    assert list(health["decode"].values()) == ["up"]


def test_metrics_count_requests_and_time_tokens(router, client):
    assert httpx.post(f"{router}/v1/completions", json={"prompt": 42}).status_code == 400
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    text = httpx.get(f"{router}/metrics").text
    assert 'tandem_router_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'tandem_router_errors_total{kind="bad_request"}' in text
    count = next(
        line for line in text.splitlines() if line.startswith("tandem_router_ttft_seconds_count")
    )
    assert float(count.split()[-1]) >= 1
    assert "tandem_router_decode_outstanding_tokens{instance=" in text


def test_request_id_is_echoed(router):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    reply = httpx.post(
        f"{router}/v1/completions", headers={"X-Request-Id": "trace-42"}, json=body, timeout=30
    )
    assert reply.headers["x-request-id"] == "trace-42"
    assert reply.json()["id"] == "cmpl-trace-42"


def test_api_key_is_required_when_set(backends):
    proc, url = start_router(*backends, "--api-key", "s3cret")
    try:
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        reply = ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
        assert reply.choices[0].text is not None
        assert httpx.get(f"{url}/health").status_code == 200  # health stays open for probes
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_queue_limit_gives_429_with_retry_after(backends):
    proc, url = start_router(*backends, "--max-queue", "1")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        long = client.completions.create(
            model=MODEL, prompt="Count:", max_tokens=300, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(long))  # the first request is being served
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == 429
        long.close()
        deadline = time.monotonic() + 10
        while httpx.post(f"{url}/v1/completions",
                         json={"prompt": "Hi", "max_tokens": 2}).status_code == 429:  # fmt: skip
            assert time.monotonic() < deadline, "the slot was never given back"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_tokenizer_mismatch_falls_back_to_the_prefills_tokenization(backends, client, tmp_path):
    """A router whose tokenizer lowercases its input disagrees with the prefill's at start-up
    and then lets the prefill tokenize: its answers equal those of a router that agrees."""
    folder = tmp_path / "lowercasing"
    shutil.copytree(MODEL, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    proc, url = start_router(*backends, "--model", str(folder), "--served-model-name", MODEL)
    try:
        health = httpx.get(f"{url}/health").json()["tokenizer"]
        assert health["source"] == "prefill" and health["parity"].startswith("mismatch")
        fallback = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for create in ("completions", "chat"):
            replies = []
            for c in (client, fallback):
                if create == "completions":
                    r = c.completions.create(model=MODEL, prompt="The Capital of FRANCE is",
                                             max_tokens=8, temperature=0)  # fmt: skip
                    replies.append((r.choices[0].text, r.usage.prompt_tokens))
                else:
                    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                  temperature=0)  # fmt: skip
                    replies.append((r.choices[0].message.content, r.usage.prompt_tokens))
            assert replies[0] == replies[1], create
    finally:
        proc.terminate()
        proc.wait(timeout=10)
