"""Starting stock vLLM (the CPU build) for the integration suites, with tandem's connector or
without."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile

import httpx
import torch

from prefill.ticket import transfer_params
from prefill.vllm_launch import READY, free_port, vllm_args
from proto.tandem.v1 import decode_pb2
from tests.servers import MODEL
from tools.launch import start

# Small on purpose: 1 GiB of KV cache, short contexts, and 64-token prefill chunks so that a
# prompt of a few hundred tokens is prefilled in several steps (chunked prefill).
MAX_BATCHED_TOKENS = 64
SMALL = ["--max-model-len", "512", "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]

# vLLM's processes talk over IPC sockets in VLLM_RPC_BASE_PATH (default: /tmp) and leave them
# there when stopped. A folder of this test process's own instead, removed at its exit; short
# (in /tmp, not Bazel's long TEST_TMPDIR), since a socket's path must fit in ~107 bytes.
_RPC_DIR = tempfile.mkdtemp(prefix="tandem-vllm-", dir="/tmp")
atexit.register(shutil.rmtree, _RPC_DIR, ignore_errors=True)


def start_vllm(
    transport: str | None, *extra: str, model: str = MODEL
) -> tuple[subprocess.Popen, str]:
    """vLLM serving `model` (the bundled one) in float32 (the decode servers' dtype), with
    TandemConnector over `transport`, or without the connector (transport None); `extra`: more
    of vLLM's arguments."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_RPC_BASE_PATH=_RPC_DIR)
    # With several ranks: vLLM's automatic binding wants a NUMA node per rank.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if "TEST_TMPDIR" in os.environ:  # vLLM caches under $HOME, read-only in Bazel's sandbox
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(os.environ["TEST_TMPDIR"], "vllm")
    port = free_port("127.0.0.1")
    args = vllm_args(model, "127.0.0.1", port, "float32", transport, *SMALL, *extra)
    proc, _ = start(args, READY, timeout=300)
    return proc, f"http://127.0.0.1:{port}"


def fp8_kv_refusal() -> str | None:
    """Why vLLM's CPU build refuses an fp8 KV cache on this machine (it needs AVX-512 or AMX),
    by vLLM's own check; None where it takes one."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 16, 64, "fp8")
    except NotImplementedError as e:
        return str(e)
    return None


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, as a user stops a server (vLLM then stops its engine processes)."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def complete(http: httpx.Client, prompt: list[int], max_tokens: int) -> dict:
    """A plain greedy completion from vLLM, no ticket: the reply's body."""
    reply = http.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()


def prefill(stub, http: httpx.Client, address: str, request_id: str, prompt: list[int],
            max_tokens: int):  # fmt: skip
    """The router's way to a prefill: Reserve on the decode server at `address`, then the POST
    to vLLM with the ticket -> (ticket, vLLM's kv_transfer_params)."""
    ticket = stub.Reserve(decode_pb2.ReserveRequest(
        request_id=request_id, prompt_token_ids=prompt, num_senders=1,
        max_tokens=max_tokens), timeout=10).ticket  # fmt: skip
    params = transfer_params(ticket, address)
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return ticket, reply.json()["kv_transfer_params"]


def generate(stub, ticket, first_token: int, max_tokens: int) -> list[int]:
    """The decode server's tokens after `first_token`, for the ticket's request."""
    stream = stub.Generate(decode_pb2.GenerateRequest(
        request_id=ticket.request_id, generation=ticket.generation,
        first_token_id=first_token, max_tokens=max_tokens), timeout=60)  # fmt: skip
    return [t for message in stream for t in message.token_ids]
