"""Stock vLLM (the CPU build) with `--kv-cache-dtype fp8` as the prefill of a tandem decode server
whose KV cache is fp8 too (`--kv-cache-dtype fp8`): vLLM's e4m3 bytes move as they are, read
through the same CPU layouts as its other caches, and the descriptor says so ("fp8_e4m3", scale
1.0). Real processes, driven as the router drives them (Reserve -> POST /v1/completions with the
ticket -> Generate).

Greedy tokens must equal vLLM's own with its fp8 cache (the same vLLM process answering a
request without a ticket), for a short prompt and one prefilled in several chunks; the decode
server must have had exactly the prompt's fp8 KV committed (one byte an element); and a decode
server whose KV cache is float32 must refuse vLLM's fp8 cache, naming both, the request failing
at once. vLLM's CPU build holds an fp8 cache only on CPUs with AVX-512 or AMX: elsewhere those
tests cannot run, and vLLM started with the flag must stop at start-up naming what is missing."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import MODEL, counter, metrics_url, start_decode
from tests.vllm_servers import (
    MAX_BATCHED_TOKENS,
    complete,
    fp8_kv_refusal,
    generate,
    prefill,
    start_vllm,
    stop,
)

REFUSAL = fp8_kv_refusal()
needs_fp8_cpu = pytest.mark.skipif(REFUSAL is not None, reason=f"vLLM on this CPU: {REFUSAL}")
NEW_TOKENS = 12
FP8 = ("--kv-cache-dtype", "fp8")
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64  # layers, K and V, KV heads, head_dim: one byte each
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him: one hundred and twelve, worn smooth in the middle by a "
    "century of boots. At the top he trimmed the wick, polished the great lens until it threw "
    "back the last of the daylight, and wrote the weather in a ledger whose first pages were "
    "in a hand nobody living could read."
)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    encode = AutoTokenizer.from_pretrained(MODEL).encode
    long = encode(TEXT)
    assert len(long) > MAX_BATCHED_TOKENS  # prefilled in chunks
    return {"short": encode("The capital of France is"), "long": long}


@pytest.fixture(scope="module")
def stack():
    """A decode server with an fp8 KV cache and vLLM with its fp8 cache and TandemConnector,
    both over tcp."""
    decode, address = start_decode("tcp", "float32", *FP8)
    vllm, url = start_vllm("tcp", *FP8)
    http = httpx.Client(base_url=url, timeout=120)
    yield address, http
    http.close()
    stop(vllm)
    stop(decode)


def _alone(http: httpx.Client, prompt: list[int]) -> list[int]:
    return complete(http, prompt, NEW_TOKENS)["choices"][0]["token_ids"]


def _prefill(stub, http, address: str, request_id: str, prompt: list[int]):
    ticket, kv = prefill(stub, http, address, request_id, prompt, NEW_TOKENS)
    return ticket, kv["first_token_id"]


def _generate(stub, ticket, first_token: int) -> list[int]:
    return generate(stub, ticket, first_token, NEW_TOKENS)


@needs_fp8_cpu
def test_vllms_fp8_kv_decoded_by_tandem_equals_vllm_alone(stack, prompts):
    address, http = stack
    metrics = metrics_url(address)
    with grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        for name, prompt in prompts.items():
            before = counter(metrics, "tandem_decode_transfer_bytes_total")
            ticket, first = _prefill(stub, http, address, name, prompt)
            assert _generate(stub, ticket, first) == _alone(http, prompt), name
            committed = counter(metrics, "tandem_decode_transfer_bytes_total") - before
            assert committed == len(prompt) * KV_BYTES_PER_TOKEN, name
        stats = stub.Stats(decode_pb2.StatsRequest())
        assert stats.kv_blocks_free == stats.kv_blocks_total


@needs_fp8_cpu
def test_a_float32_decode_server_refuses_vllms_fp8_kv_naming_both(stack, prompts):
    _, http = stack
    decode, address = start_decode("tcp")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            ticket, first = _prefill(stub, http, address, "f32", prompts["short"])
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                _generate(stub, ticket, first)
            assert time.monotonic() - started < 5  # the refusal, not the ticket's deadline
            assert error.value.code() == grpc.StatusCode.ABORTED
            details = error.value.details()
            assert "decode has 'float32', sender has 'fp8_e4m3'" in details, details
    finally:
        stop(decode)


@pytest.mark.skipif(REFUSAL is None, reason="this CPU holds vLLM's fp8 cache: the tests above run")
def test_vllm_refuses_an_fp8_cache_at_start_up_on_a_cpu_that_cannot_hold_one():
    with pytest.raises(RuntimeError, match="FP8 KV cache on CPU requires x86 with AVX-512 or AMX"):
        stop(start_vllm("tcp", *FP8)[0])
