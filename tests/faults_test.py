"""Failures across processes end with an explicit error in bounded time, never a hang, and the
decode server's KV pool returns to all free."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from prefill.ticket import transfer_params
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import COMMON, decode_pool_free, start_decode, start_prefill

LONG_PROMPT = list(range(100, 1100))


@pytest.fixture()
def decode():
    proc, address = start_decode("tcp")
    channel = grpc.insecure_channel(address)
    yield proc, address, decode_pb2_grpc.DecodeServiceStub(channel)
    channel.close()
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def test_prefill_killed_mid_transfer_fails_generate_by_the_deadline(decode):
    _, address, stub = decode
    prefill, url = start_prefill("tcp")
    ticket = stub.Reserve(
        decode_pb2.ReserveRequest(
            request_id="k", prompt_token_ids=LONG_PROMPT, num_senders=1, max_tokens=4,
            transfer_timeout_ms=1500,
        ),
        timeout=10,
    ).ticket  # fmt: skip
    params = transfer_params(ticket, address)
    body = {"prompt": LONG_PROMPT, "max_tokens": 1, "kv_transfer_params": params}
    client = httpx.Client(base_url=url, timeout=30)
    with contextlib.suppress(httpx.TimeoutException):  # the prefill is under way; now it dies
        client.post("/v1/completions", json=body, timeout=0.05)
    prefill.send_signal(signal.SIGKILL)
    prefill.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Generate(
                decode_pb2.GenerateRequest(
                    request_id="k", generation=ticket.generation, first_token_id=1
                ),
                timeout=30,
            )
        )
    assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
    assert time.monotonic() - start < 3
    assert decode_pool_free(address)  # quarantine ends one grace second after the deadline


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(decode):
    proc, address, stub = decode
    prefill, url = start_prefill("tcp")
    try:
        ticket = stub.Reserve(decode_pb2.ReserveRequest(
            request_id="d", prompt_token_ids=[5, 6, 7], num_senders=1, max_tokens=2000),
            timeout=10).ticket  # fmt: skip
        params = transfer_params(ticket, address)
        reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "prompt": [5, 6, 7], "max_tokens": 1, "kv_transfer_params": params})  # fmt: skip
        first = reply.json()["kv_transfer_params"]["first_token_id"]
        stream = stub.Generate(decode_pb2.GenerateRequest(
            request_id="d", generation=ticket.generation, first_token_id=first,
            max_tokens=2000, ignore_eos=True), timeout=60)  # fmt: skip
        next(stream)
        proc.send_signal(signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert time.monotonic() - start < 5
    finally:
        prefill.terminate()
        prefill.wait(timeout=10)


TINY = ["--model", "random:tiny", "--dtype", "float32"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "/nonexistent"], "is not a Hugging Face folder"),
        (["--model", "random:tiny", "--transport", "carrier-pigeon"], "transport"),
        ([*TINY, "--kv-cache-gb", "-1"], "kv_cache_gb"),
        # More than the host has: refused before the zeros touch the pages (no OOM kill).
        ([*TINY, "--kv-cache-gb", "100000"], "fix: lower --kv-cache-gb"),
        ([*TINY, "--max-model-len", "1025"],  # tiny's max_position_embeddings: 1024
         "past the model's max_position_embeddings 1024; fix: lower --max-model-len"),
        ([*TINY, "--max-model-len", "1000", "--kv-cache-gb", "0.0001"],  # 208 tokens of 512 B
         "fix: raise --kv-cache-gb or lower --max-model-len"),
    ],
)  # fmt: skip
def test_bad_configuration_exits_with_one_line_naming_the_fix(args, expected):
    done = subprocess.run(
        [sys.executable, "-m", "decode.server", *args], capture_output=True, text=True,
        timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("decode.server: cannot start:") and expected in last
    assert "Traceback" not in done.stderr


def test_port_taken_exits_with_one_line(decode):
    _, address, _ = decode
    port = address.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "decode.server", *COMMON, "--grpc-port", port],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode != 0
    assert "cannot start" in done.stderr and "Traceback" not in done.stderr
