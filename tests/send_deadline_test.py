"""The one KV send path against a real decode server (in this process, tiny random model, TCP):
no write lands after a ticket's deadline, whatever the sender's own timeout, for tandem's
prefill and for the vLLM connector's worker side alike; the decode pool is all free afterwards;
and an unreachable decode server does not hold up tickets for a healthy one."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

import transport
from decode.server import DecodeServerConfig
from engine.llm_engine import EngineConfig
from prefill.kv_sender import DEADLINE_PASSED, KvSender
from prefill.kv_writes import BlockLayout, LayerKV, layer_ops
from prefill.server import PrefillServer, PrefillServerConfig
from prefill.ticket import KvTransfer, transfer_params
from prefill.vllm_config import TandemConnectorConfig
from prefill.vllm_metadata import SendPlan, TandemMetadata
from prefill.vllm_worker_side import WorkerFacts, WorkerSide
from proto.tandem.v1 import decode_pb2
from tests.servers import serving_decode
from transport.config import KvTransportConfig

ENGINE = dict(model="random:tiny", dtype="float32", block_size=16, kv_cache_gb=0.01)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # engine/config.py's "tiny"
PROMPT = list(range(1, 41))


@pytest.fixture(scope="module")
def decode():
    with serving_decode(DecodeServerConfig(EngineConfig(**ENGINE))) as served:
        yield served


@pytest.fixture(scope="module")
def prefill():
    # The prefill's own timeout is far longer than any ticket's deadline here.
    config = PrefillServerConfig(EngineConfig(**ENGINE), KvTransportConfig(transfer_timeout_s=60.0))
    server = PrefillServer(config)
    yield server, TestClient(server.app)
    server.stop()


def _reserve(stub, request_id: str, timeout_ms: int = 0) -> decode_pb2.Ticket:
    request = decode_pb2.ReserveRequest(
        request_id=request_id, prompt_token_ids=PROMPT, num_senders=1, max_tokens=4,
        transfer_timeout_ms=timeout_ms,
    )  # fmt: skip
    return stub.Reserve(request, timeout=10).ticket


def _address(decode) -> str:
    return f"127.0.0.1:{decode[0].port}"


def _assert_pool_all_free(stub, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        stats = stub.Stats(decode_pb2.StatsRequest(), timeout=5)
        if stats.kv_blocks_free == stats.kv_blocks_total and not stats.reserved:
            return
        assert time.monotonic() < deadline, f"pool not all free: {stats}"
        time.sleep(0.05)


def _wait_past(ticket: decode_pb2.Ticket) -> None:
    time.sleep(max(0.0, ticket.deadline_unix_ms / 1000 - time.time()) + 0.05)


def test_tandem_prefill_taking_a_ticket_late_writes_nothing_and_fails_it(decode, prefill):
    server, stub = decode
    server.engine.kv_cache.storage.fill_(0)
    ticket = _reserve(stub, "late-embedded", timeout_ms=200)
    _wait_past(ticket)  # the job reaches the prefill after the ticket's deadline
    body = {"prompt": PROMPT, "max_tokens": 1,
            "kv_transfer_params": transfer_params(ticket, _address(decode))}  # fmt: skip
    reply = prefill[1].post("/v1/completions", json=body)
    assert reply.status_code == 502 and DEADLINE_PASSED in reply.json()["error"]["message"]
    assert not server.engine.kv_cache.storage.any(), "a write landed after the deadline"
    _assert_pool_all_free(stub)


def test_vllm_worker_side_taking_a_ticket_late_writes_nothing_and_fails_it(decode):
    server, stub = decode
    server.engine.kv_cache.storage.fill_(0)
    ticket = _reserve(stub, "late-vllm", timeout_ms=200)
    worker = WorkerSide(
        TandemConnectorConfig(transfer_timeout_s=60.0),
        WorkerFacts("tiny", KV_HEADS, HEAD_DIM, block_size=16, tp_rank=0, tp_size=1),
        transport.create("tcp"),
    )
    # FlashAttention's cache [2, blocks, block_size, heads, head_dim] per layer, all written.
    caches = [torch.randn(2, 4, 16, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register(list(zip(names, caches, strict=True)), "FLASH_ATTN")
    _wait_past(ticket)
    plan = SendPlan("r", 0, len(PROMPT), (0, 1, 2), True, ticket.SerializeToString(),
                    _address(decode))  # fmt: skip
    worker.bind(TandemMetadata([plan]))
    for name in names:
        worker.save_layer(name)
    worker.step_done()
    _assert_pool_all_free(stub)
    worker.close()
    assert not server.engine.kv_cache.storage.any(), "a write landed after the deadline"


class _Clock:
    """The sender's clock, moved by the test (its sessions' deadlines are on it)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def test_a_sender_whose_timeout_outlasts_the_ticket_stops_writing_at_its_deadline(decode):
    """Layer 0 goes before the ticket's deadline; layer 1 would go after it, well inside the
    sender's own 60 s: it is never posted, and the commit says why."""
    server, stub = decode
    storage = server.engine.kv_cache.storage
    storage.fill_(0)
    ticket = _reserve(stub, "outlasted", timeout_ms=2000)
    clock = _Clock()
    agent = transport.create("tcp")
    source = torch.randn(LAYERS, 2, 4, KV_HEADS, 16, HEAD_DIM)
    agent.register(source.data_ptr(), source.numel() * source.element_size())
    sender = KvSender(
        agent, server.servicer.layout, sender_id="test", rank=0, heads=range(KV_HEADS),
        token_bytes=HEAD_DIM * 4, timeout_s=60.0, clock=clock,
    )  # fmt: skip
    session = sender.open(KvTransfer(ticket, _address(decode)))
    assert session.deadline <= clock.now + 2.0, "the ticket's deadline bounds the session"
    src = BlockLayout(16, source.stride(2) * 4, source.stride(3) * 4, HEAD_DIM * 4)

    def layer(i: int):
        def build(target):
            dst = target.shard.layers[i]
            return layer_ops(
                LayerKV(source[i, 0].data_ptr(), source[i, 1].data_ptr()),
                LayerKV(dst.k.addr, dst.v.addr), src, session.dst_layout, [0, 1, 2],
                list(ticket.block_ids), len(PROMPT), target.heads,
            )  # fmt: skip

        return build

    assert sender.post(session, layer(0), completes_layer=0).result(timeout=10)
    clock.now = session.deadline + 0.001
    assert sender.post(session, layer(1), completes_layer=1).result(timeout=10) == []
    stats = sender.finish(session).result(timeout=10)
    assert stats.error == DEADLINE_PASSED and stats.layers == 0
    blocks = list(ticket.block_ids)
    assert storage[0][:, blocks].any() and not storage[1].any(), "layer 1 must not be written"
    _assert_pool_all_free(stub)
    sender.close()
    agent.close()


@pytest.fixture()
def unreachable():
    """A decode address that accepts TCP connections and never answers (a hung host)."""
    sock = socket.create_server(("127.0.0.1", 0))
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_an_unreachable_decode_server_does_not_delay_tickets_for_a_healthy_one(
    decode, prefill, unreachable
):
    _, stub = decode
    client = prefill[1]

    def complete(ticket, address) -> tuple[int, float]:
        body = {"prompt": PROMPT, "max_tokens": 1,
                "kv_transfer_params": transfer_params(ticket, address)}  # fmt: skip
        start = time.monotonic()
        reply = client.post("/v1/completions", json=body)
        return reply.status_code, time.monotonic() - start

    pool = ThreadPoolExecutor(2)
    hung = pool.submit(complete, _reserve(stub, "to-hung"), unreachable)
    time.sleep(0.2)  # its Hello is under way
    for i in range(3):
        status, seconds = complete(_reserve(stub, f"healthy-{i}"), _address(decode))
        assert status == 200 and seconds < 2.0, (status, seconds)
        # Committed: READY, its blocks freed once nobody decodes it.
        stub.Abort(decode_pb2.AbortRequest(request_id=f"healthy-{i}"), timeout=5)
    status, seconds = hung.result(timeout=30)
    assert status == 502
    # The failure is remembered: the next ticket for that server fails at once.
    status, seconds = complete(_reserve(stub, "to-hung-again"), unreachable)
    assert status == 502 and seconds < 1.0, (status, seconds)
    pool.shutdown()
    for request_id in ("to-hung", "to-hung-again"):  # no sender ever reached their blocks
        abort = decode_pb2.AbortRequest(request_id=request_id, ticket_undelivered=True)
        stub.Abort(abort, timeout=5)
    _assert_pool_all_free(stub)
