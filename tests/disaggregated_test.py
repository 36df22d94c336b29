"""Prefill on one process, decode on another, over each transport: real servers, started as a
user would (`python -m decode.server`, `python -m prefill.server`), driven by a router-less
client: Reserve on decode -> POST /v1/completions on prefill with the ticket -> Generate.

Greedy tokens must equal one engine doing the whole request and Hugging Face transformers, for
concurrent requests of different lengths, and decode must batch them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from prefill.ticket import transfer_params
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import MODEL, PeakRunning, start_decode, start_prefill

PROMPTS = [
    [1, 504, 3458, 2767, 28, 1442, 1463, 253, 2353],
    list(range(100, 170)),
    [9690, 198, 2683, 359, 253, 5356, 5646],
    list(range(3000, 3021)),
]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["tcp", "shm", "mooncake", "nixl"])
def stack(request):
    decode, decode_address = start_decode(request.param)
    prefill, prefill_url = start_prefill(request.param)
    channel = grpc.insecure_channel(decode_address)
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    http = httpx.Client(base_url=prefill_url, timeout=60)
    yield stub, http, decode_address
    http.close()
    channel.close()
    for proc in (prefill, decode):
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def hugging_face() -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def _request(stub, http, decode_address: str, request_id: str, prompt: list[int]):
    ticket = stub.Reserve(
        decode_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, num_senders=1, max_tokens=NEW_TOKENS
        ),
        timeout=10,
    ).ticket
    params = transfer_params(ticket, decode_address)
    reply = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params},
    )
    assert reply.status_code == 200, reply.text
    kv = reply.json()["kv_transfer_params"]
    assert kv["layers"] == 30
    assert kv["bytes_written"] == len(prompt) * 30 * 2 * 3 * 64 * 4  # fp32, 3 KV heads
    # A short prompt's 30 layers hold far less than publisher.GROUP_BYTES: one post, one write.
    assert kv["posts"] == 1
    stream = stub.Generate(
        decode_pb2.GenerateRequest(
            request_id=request_id, generation=ticket.generation,
            first_token_id=kv["first_token_id"], max_tokens=NEW_TOKENS,
        ),
        timeout=60,
    )  # fmt: skip
    return [t for message in stream for t in message.token_ids]


def test_disaggregated_greedy_equals_hugging_face_and_decode_batches(stack, hugging_face):
    stub, http, decode_address = stack
    with PeakRunning(stub) as running, ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(
            pool.map(
                lambda i: _request(stub, http, decode_address, f"r{i}", PROMPTS[i]),
                range(len(PROMPTS)),
            )
        )
    assert outs == hugging_face
    assert running.peak > 1
    stats = stub.Stats(decode_pb2.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_prefill_answers_like_vllm(stack):
    _, http, _ = stack
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    bad = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "best_of": 3})
    assert bad.status_code == 400 and "best_of" in bad.json()["error"]["message"]
    ticketless = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
    assert ticketless.status_code == 200 and len(ticketless.json()["choices"][0]["token_ids"]) == 3
