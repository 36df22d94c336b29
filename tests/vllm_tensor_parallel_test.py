"""Stock vLLM at --tensor-parallel-size 2 (the CPU build) as tandem's prefill: each of its ranks
sends the KV heads it holds and commits for itself (the router reserves without a sender count;
the commits name two). Through the router into tandem decode servers at TP 1 and TP 2 (a tiny
random Llama of 4 KV heads with SmolLM2's tokenizer), greedy completions equal vLLM's own (a
request without a ticket, which the connector leaves alone); each decode server counts bytes
from sender ranks 0 and 1; every block is free afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.servers import counter, decode_pool_free, stop
from tests.tiny_folders import write_tiny_kv4
from tests.vllm_servers import start_vllm
from tools.launch import start

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:", "Once upon a time"]
MAX_TOKENS = 12
ARGS = ["--dtype", "float32", "--block-size", "16", "--kv-cache-gb", "0.05", "--transport", "tcp"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """vLLM TP 2 -> a router and a decode server at TP 1; the same vLLM -> a router and a decode
    server at TP 2."""
    folder = str(write_tiny_kv4(tmp_path_factory.mktemp("tiny-kv4")))
    vllm, vllm_url = start_vllm("tcp", "--tensor-parallel-size", "2", model=folder)
    procs, routes = [vllm], {}
    try:
        for tp in (1, 2):
            decode, m = start(
                ["decode.server", "--model", folder, *ARGS, "--tensor-parallel-size", str(tp),
                 "--grpc-port", "0", "--metrics-port", "0"],
                r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
            )  # fmt: skip
            address = f"127.0.0.1:{m.group(1)}"
            metrics = f"http://127.0.0.1:{m.group(2)}/metrics"
            router, r = start(
                ["router.server", "--model", folder, "--served-model-name", "tiny-kv4",
                 "--port", "0", "--prefill", vllm_url, "--decode", address,
                 "--no-decode-only-fallback"],
                r"serving on (http://[\d.:]+)",
            )  # fmt: skip
            procs += [decode, router]
            routes[tp] = (r.group(1), address, metrics)
        yield vllm_url, folder, routes
    finally:
        stop(*reversed(procs))


def _body(prompt: str, model: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_vllm_tp2_through_the_router_equals_vllm_alone(stack, decode_tp):
    vllm_url, folder, routes = stack
    url, address, metrics = routes[decode_tp]
    for prompt in PROMPTS:
        alone = httpx.post(f"{vllm_url}/v1/completions", json=_body(prompt, folder), timeout=120)
        assert alone.status_code == 200, alone.text
        served = httpx.post(f"{url}/v1/completions", json=_body(prompt, "tiny-kv4"), timeout=120)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    text = httpx.get(metrics, timeout=10).text
    for rank in (0, 1):  # each of vLLM's ranks sent its heads
        name = f'tandem_decode_transfer_bytes_total{{sender_rank="{rank}"}}'
        assert counter(metrics, name) > 0, text
    assert decode_pool_free(address) is not None
