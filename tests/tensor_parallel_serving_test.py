"""A tensor-parallel decode server in the served stack, with real processes on the CPU (gloo):
a tiny random Llama of 8 heads and 4 KV heads with SmolLM2's tokenizer, as a Hugging Face folder.
- tandem's prefill (TP 1, one sender) -> router -> decode at TP 2: the sender writes each of
  its heads into the rank that holds it; greedy completions (n=1 and n=2, whose second choice
  copies a partial block on every rank) equal one engine at TP 1; the sender's bytes counted
  under its rank; every block free afterwards.
- a decode rank killed mid-stream: the client's stream ends with an error within 5 s, the
  server reports not serving, the next request fails fast instead of hanging.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import counter, decode_pool_free, stop
from tests.tiny_kv4 import write_tiny_kv4
from tools.launch import start

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]
MAX_TOKENS = 12
ARGS = ["--dtype", "float32", "--block-size", "16", "--kv-cache-gb", "0.05"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_kv4(tmp_path_factory.mktemp("tiny-kv4"))


@pytest.fixture(scope="module")
def stack(folder):
    """Prefill at TP 1 -> router -> decode at TP 2, over tcp."""
    model = ["--model", str(folder), *ARGS, "--transport", "tcp"]
    decode, m = start(
        ["decode.server", *model, "--tensor-parallel-size", "2", "--grpc-port", "0",
         "--metrics-port", "0"],
        r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
    )  # fmt: skip
    address, metrics = f"127.0.0.1:{m.group(1)}", f"http://127.0.0.1:{m.group(2)}/metrics"
    prefill, m = start(["prefill.server", *model, "--port", "0"], r"serving on (http://[\d.:]+)")
    router, m = start(
        ["router.server", "--model", str(folder), "--served-model-name", "tiny-kv4",
         "--port", "0", "--prefill", m.group(1), "--decode", address,
         "--no-decode-only-fallback"],
        r"serving on (http://[\d.:]+)",
    )  # fmt: skip
    yield {"url": m.group(1), "decode": decode, "address": address, "metrics": metrics}
    stop(router, prefill, decode)


@pytest.fixture(scope="module")
def reference(folder) -> list[str]:
    """Greedy texts of one engine at TP 1."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LLMEngine.build(EngineConfig(model=str(folder), dtype="float32", block_size=16))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    stop_at = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [tokenizer.decode(out) for out in engine.generate(prompts, SamplingParams(), stop_at)]


def _complete(url: str, prompt: str, n: int = 1, max_tokens: int = MAX_TOKENS, **extra):
    body = {"model": "tiny-kv4", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "n": n, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_tp2_decode_behind_a_tp1_prefill_equals_one_engine(stack, reference):
    before = counter(stack["metrics"], "tandem_decode_transfer_bytes_total")
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        reply = _complete(stack["url"], prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    # Both choices of n=2 (the prompt's partial last block copied on each rank); top_k 1: both
    # greedy.
    reply = _complete(stack["url"], PROMPTS[0], n=2, temperature=1.0, top_k=1)
    assert reply.status_code == 200, reply.text
    assert [c["text"] for c in reply.json()["choices"]] == [reference[0]] * 2
    text = httpx.get(stack["metrics"], timeout=10).text
    assert 'tandem_decode_transfer_bytes_total{sender_rank="0"}' in text
    assert counter(stack["metrics"], "tandem_decode_transfer_bytes_total") > before
    assert decode_pool_free(stack["address"]) is not None


def test_a_decode_rank_killed_mid_stream_ends_the_stream_and_the_server_serves_no_more(stack):
    # Last in this module: it leaves the decode server failed.
    rank = _child(stack["decode"].pid)
    body = {"model": "tiny-kv4", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    killed, chunks, error = [], 0, None
    with httpx.stream("POST", f"{stack['url']}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if "error" in json.loads(line[6:]):
                error = json.loads(line[6:])["error"]
            if chunks == 5:
                threading.Thread(target=lambda: killed.append(_kill(rank))).start()
    assert error is not None and "tensor-parallel rank 1" in error["message"], error
    assert time.monotonic() - killed[0] < 5
    stub = decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(stack["address"]))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Stats(decode_pb2.StatsRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    started = time.monotonic()
    assert _complete(stack["url"], PROMPTS[1]).status_code == 503
    assert time.monotonic() - started < 10


def _child(pid: int) -> int:
    """The one child process of `pid` (the decode server's rank 1)."""
    children = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(children) == 1, children
    return int(children[0])


def _kill(pid: int) -> float:
    subprocess.run(["kill", "-9", str(pid)], check=True)
    return time.monotonic()
