"""The decode server end to end over gRPC and a real transport, on the bundled SmolLM2.

A sender in this process plays the prefill engine: it prefills the prompt with its own engine,
writes the KV into the ticket's blocks with the send path's write descriptors
(prefill/kv_writes.py), and commits. The decoded tokens must equal one engine doing the whole
request. Fault cases end with an explicit status in bounded time and the pool back to all free.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import transport
from decode.engine_loop import Choice, EngineFailed
from decode.server import DecodeServer, DecodeServerConfig
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from prefill.kv_writes import BlockLayout, LayerKV, layer_ops, valid_bytes
from prefill.ticket import PREFILL_LAYOUT, commit_notice, layout_descriptor
from proto.tandem.v1 import decode_pb2
from rpc import health
from tests.servers import PeakRunning, serving_decode
from transport.config import KvTransportConfig

MODEL = "tools/smollm2-135m-instruct"  # Bazel data: //tools:smollm2
ENGINE = dict(model=MODEL, dtype="float32", block_size=16, kv_cache_gb=0.1)
PROMPTS = [
    [1, 504, 3458, 2767, 28, 1442, 1463, 253, 2353],
    list(range(100, 160)),
    [9690, 198, 2683, 359, 253, 5356, 5646],
    list(range(3000, 3037)),
]
NEW_TOKENS = 12


class Sender:
    """A prefill engine and its transport agent, sending to one decode server."""

    def __init__(self, stub, backend: str) -> None:
        self.stub = stub
        self.engine = LLMEngine.build(EngineConfig(**ENGINE))
        self.agent = transport.create(backend)
        self.agent.register(*self.engine.kv_cache.region())
        model = self.engine.model_config
        self.layout = layout_descriptor(
            model_name=MODEL, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim, kv_dtype="float32", block_size=16, layout=PREFILL_LAYOUT,
            transport=backend,
        )  # fmt: skip
        self._peers: dict[bytes, object] = {}
        self._lock = threading.Lock()

    def hello(self) -> None:
        self.stub.Hello(decode_pb2.HelloRequest(sender_layout=self.layout, sender_id="test"))

    def reserve(self, request_id: str, prompt: list[int], timeout_ms: int = 0, senders: int = 1):
        request = decode_pb2.ReserveRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            num_senders=senders,
            max_tokens=NEW_TOKENS,
            transfer_timeout_ms=timeout_ms,
        )
        return self.stub.Reserve(request, timeout=10).ticket

    def prefill_and_write(
        self, ticket, prompt: list[int], *, drop_layers: int = 0, heads: range = range(3)
    ) -> int:
        """Prefills locally, writes the KV into the ticket's blocks; returns the first token."""
        with self._lock:  # one engine, stepped by one thread at a time
            seq = self.engine.add_request(
                ticket.request_id, prompt, SamplingParams(), StopConditions(max_tokens=2)
            )
            [out] = self.engine.step()
            kv = self.engine.kv_cache
            src_layout = BlockLayout(16, kv.block_stride_bytes, kv.head_stride_bytes, 64 * 4)
            dst_layout = BlockLayout(
                ticket.layout.block_size, ticket.block_stride_bytes, ticket.head_stride_bytes,
                64 * 4,
            )  # fmt: skip
            shard = ticket.shards[0]
            ops = []
            layers = len(shard.layers) - drop_layers
            for layer, (k, v) in enumerate(kv.kv_caches[:layers]):
                dst = shard.layers[layer]
                ops += layer_ops(
                    LayerKV(k.data_ptr(), v.data_ptr()), LayerKV(dst.k.addr, dst.v.addr),
                    src_layout, dst_layout, seq.block_ids, list(ticket.block_ids),
                    ticket.num_tokens, heads,
                )  # fmt: skip
            peer = self._peer(shard.endpoint.metadata)
            self.agent.write(peer, ops, time.monotonic() + 10).wait()
            self.engine.abort(ticket.request_id)
        return out.token_id

    def commit(self, ticket, nbytes=None, layers: int = 30, generation=None, rank=0, heads=3):
        request = self.commit_request(ticket, nbytes, layers, generation, rank, heads)
        return self.stub.Commit(request, timeout=10)

    def commit_request(
        self, ticket, nbytes=None, layers: int = 30, generation=None, rank=0, heads=3
    ) -> decode_pb2.CommitRequest:
        return decode_pb2.CommitRequest(
            request_id=ticket.request_id,
            generation=ticket.generation if generation is None else generation,
            sender_rank=rank,
            bytes_written=valid_bytes(ticket.num_tokens, heads, 64 * 4, 30)
            if nbytes is None
            else nbytes,
            layers_written=layers,
        )

    def notify(self, ticket, payload: bytes) -> None:
        """Sends `payload` as a notification to the ticket's rank-0 agent, as a sender's commit
        goes where the ticket takes one."""
        peer = self._peer(ticket.shards[0].endpoint.metadata)
        self.agent.write(peer, [], time.monotonic() + 10, notify=payload).wait()

    def generate(self, ticket, first_token: int, **kwargs):
        return self.stub.Generate(
            decode_pb2.GenerateRequest(
                request_id=ticket.request_id,
                generation=ticket.generation,
                first_token_id=first_token,
                max_tokens=NEW_TOKENS,
                **kwargs,
            ),
            timeout=60,
        )

    def _peer(self, endpoint: bytes):
        if endpoint not in self._peers:
            self._peers[endpoint] = self.agent.connect(endpoint, time.monotonic() + 10)
        return self._peers[endpoint]


@pytest.fixture(scope="module", params=["tcp", "shm"])
def stack(request):
    config = DecodeServerConfig(
        engine=EngineConfig(**ENGINE), kv=KvTransportConfig(request.param), metrics_port=0
    )
    with serving_decode(config) as (server, stub):
        sender = Sender(stub, request.param)
        sender.hello()
        yield server, stub, sender
        sender.agent.close()


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    engine = LLMEngine.build(EngineConfig(**ENGINE))
    outs = engine.generate(PROMPTS, SamplingParams(), StopConditions(max_tokens=NEW_TOKENS))
    return dict(enumerate(outs))


def _assert_pool_free(server: DecodeServer, stub) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = stub.Stats(decode_pb2.StatsRequest())
        if stats.kv_blocks_free == stats.kv_blocks_total and not stats.running + stats.reserved:
            break
        time.sleep(0.05)
    assert (stats.kv_blocks_free, stats.running, stats.reserved) == (stats.kv_blocks_total, 0, 0)
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    assert f"tandem_decode_kv_blocks_free {float(stats.kv_blocks_total)}".encode() in scrape


def _run(sender, request_id: str, prompt: list[int]) -> list[int]:
    ticket = sender.reserve(request_id, prompt)
    first = sender.prefill_and_write(ticket, prompt)
    sender.commit(ticket)
    messages = list(sender.generate(ticket, first))
    assert messages[-1].finish_reason in (
        decode_pb2.FINISH_REASON_LENGTH,
        decode_pb2.FINISH_REASON_STOP,
    )
    return [t for m in messages for t in m.token_ids]


def test_disaggregated_tokens_equal_one_engine_and_requests_batch(stack, reference):
    server, stub, sender = stack
    with PeakRunning(stub) as running, ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda i: _run(sender, f"r{i}", PROMPTS[i]), range(len(PROMPTS))))
    assert outs == [reference[i] for i in range(len(PROMPTS))]
    assert running.peak > 1  # decoded as a batch, not one at a time
    _assert_pool_free(server, stub)


def test_commit_never_sent_fails_generate_at_the_deadline(stack):
    server, stub, sender = stack
    ticket = sender.reserve("late", PROMPTS[0], timeout_ms=400)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(sender.generate(ticket, 1))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 2
    _assert_pool_free(server, stub)  # quarantine ends one grace second after the deadline


def test_short_transfer_fails_loudly_never_decodes(stack):
    server, stub, sender = stack
    ticket = sender.reserve("short", PROMPTS[1])
    first = sender.prefill_and_write(ticket, PROMPTS[1], drop_layers=1)
    with pytest.raises(grpc.RpcError) as err:
        sender.commit(ticket, layers=29)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "29 layers" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(sender.generate(ticket, first))
    assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED)
    _assert_pool_free(server, stub)


def test_stale_commit_is_refused_and_changes_nothing(stack, reference):
    server, stub, sender = stack
    old = sender.reserve("again", PROMPTS[2])
    stub.Abort(decode_pb2.AbortRequest(request_id="again", reason="retry"))
    new = sender.reserve("again", PROMPTS[2])
    assert new.generation == old.generation + 1
    with pytest.raises(grpc.RpcError) as err:
        sender.commit(old)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    first = sender.prefill_and_write(new, PROMPTS[2])
    sender.commit(new)
    sender.commit(new)  # a duplicate commit of the same rank is harmless
    tokens = [t for m in sender.generate(new, first) for t in m.token_ids]
    assert tokens == reference[2]
    _assert_pool_free(server, stub)


def test_a_commit_by_notification_decodes_as_one_by_rpc(stack, reference):
    """The server's tickets take commits as transport notifications: one that is not a commit,
    or a refused one (too few layers), is logged and fails nothing else; a good one readies its
    ticket without any Commit RPC, and the tokens are the single-engine ones."""
    server, stub, sender = stack
    bad = sender.reserve("bad-notice", PROMPTS[1])
    assert bad.commit_by_notification
    sender.notify(bad, b"not a commit")
    sender.notify(bad, commit_notice(sender.commit_request(bad, layers=29)))
    with pytest.raises(grpc.RpcError) as err:
        list(sender.generate(bad, 1))
    assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED)
    assert "29 layers" in err.value.details()

    ticket = sender.reserve("notice", PROMPTS[0])
    first = sender.prefill_and_write(ticket, PROMPTS[0])
    sender.notify(ticket, commit_notice(sender.commit_request(ticket)))
    assert [t for m in sender.generate(ticket, first) for t in m.token_ids] == reference[0]
    _assert_pool_free(server, stub)


def test_reserve_beyond_capacity_is_resource_exhausted(stack):
    server, stub, sender = stack
    total = stub.Stats(decode_pb2.StatsRequest()).kv_blocks_total
    with pytest.raises(grpc.RpcError) as err:
        sender.reserve("huge", [5] * (total * 16 + 1))
    assert err.value.code() in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,  # longer than the context, checked first
    )
    _assert_pool_free(server, stub)


def test_client_abort_mid_stream_frees_the_sequence(stack):
    server, stub, sender = stack
    ticket = sender.reserve("gone", PROMPTS[3])
    first = sender.prefill_and_write(ticket, PROMPTS[3])
    sender.commit(ticket)
    stream = sender.generate(ticket, first, ignore_eos=True)
    next(stream)
    stream.cancel()
    _assert_pool_free(server, stub)


def test_mismatched_layout_is_refused_at_hello_naming_both_values(stack):
    _, stub, sender = stack
    bad = decode_pb2.HelloRequest(sender_layout=sender.layout, sender_id="p9")
    bad.sender_layout.model.num_layers = 32
    bad.sender_layout.model.kv_dtype = "bfloat16"
    with pytest.raises(grpc.RpcError) as err:
        stub.Hello(bad)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "num_layers: decode has 30, sender has 32" in err.value.details()
    assert "kv_dtype: decode has 'float32', sender has 'bfloat16'" in err.value.details()


def test_two_sender_ranks_each_write_their_heads(stack, reference):
    """Tensor-parallel prefill: rank 0 owns KV heads [0, 2), rank 1 head 2; decoding starts only
    once both committed, and the tokens are the single-engine ones."""
    server, stub, sender = stack
    ticket = sender.reserve("tp", PROMPTS[1], senders=2)
    first = sender.prefill_and_write(ticket, PROMPTS[1], heads=range(0, 2))
    assert sender.commit(ticket, rank=0, heads=2).committed_senders == 1
    assert stub.Stats(decode_pb2.StatsRequest()).reserved == 1  # still waiting for rank 1
    sender.prefill_and_write(ticket, PROMPTS[1], heads=range(2, 3))
    done = sender.commit(ticket, rank=1, heads=1)
    assert (done.committed_senders, done.expected_senders) == (2, 2)
    assert [t for m in sender.generate(ticket, first) for t in m.token_ids] == reference[1]
    _assert_pool_free(server, stub)


def _health(server: DecodeServer, service: str = "") -> int:
    """grpc.health.v1.Health/Check's status, as a Kubernetes gRPC probe asks for it."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        check = channel.unary_unary(
            f"/{health.SERVICE}/Check",
            request_serializer=health.encode_request,
            response_deserializer=health.decode_status,
        )
        return check(service, timeout=5)


def test_grpc_health_says_serving_until_a_drain_begins(stack):
    server, _, _ = stack
    assert _health(server) == health.SERVING
    assert _health(server, "tandem.v1.DecodeService") == health.SERVING
    assert _health(server, "other.Service") == health.SERVICE_UNKNOWN
    server.servicer.draining = True
    try:
        assert _health(server) == health.NOT_SERVING
    finally:
        server.servicer.draining = False


def test_an_engine_failure_ends_every_stream_and_refuses_new_work():
    """A step that raises (a CUDA error, say) loses the engine's state: the open stream ends
    UNAVAILABLE naming the error instead of waiting forever, and the instance refuses work (so
    the router marks it down) until it is restarted."""
    config = DecodeServerConfig(engine=EngineConfig(**ENGINE), metrics_port=0)
    with serving_decode(config) as (server, stub):
        sender = Sender(stub, "tcp")
        try:
            sender.hello()
            ready = {}  # request id -> (ticket with its KV committed, first token)
            for request_id, prompt in [("live", PROMPTS[3]), ("ready", PROMPTS[0])]:
                ticket = sender.reserve(request_id, prompt)
                ready[request_id] = ticket, sender.prefill_and_write(ticket, prompt)
                sender.commit(ticket)

            real_step, steps = server.engine.step, []

            def failing_step(*args, **kwargs):
                steps.append(1)
                if len(steps) > 3:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                return real_step(*args, **kwargs)

            server.engine.step = failing_step
            tokens = []
            with pytest.raises(grpc.RpcError) as err:
                for message in sender.generate(*ready["live"]):
                    tokens += message.token_ids
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "RuntimeError: CUDA error: an illegal memory access" in err.value.details()
            assert "restart the decode server" in err.value.details()
            assert len(tokens) == 4  # the first token, then one a step until the failing one

            refused = [
                lambda: stub.Stats(decode_pb2.StatsRequest(), timeout=10),
                lambda: sender.reserve("after", PROMPTS[1]),
                lambda: list(sender.generate(*ready["ready"])),
            ]
            for call in refused:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "RuntimeError: CUDA error" in err.value.details()
            # A submit that raced the failure past the RPC's check still ends at once.
            late = server.engine.new_sequence(
                "late", PROMPTS[1], SamplingParams(), StopConditions(2)
            )
            with ThreadPoolExecutor(1) as pool:
                stream = server.loop.submit("late", [Choice(late, 7)], [])
                items = pool.submit(list, stream).result(timeout=10)
            assert items == [EngineFailed(server.loop.failure)]
            scrape = urllib.request.urlopen(
                f"http://127.0.0.1:{server.metrics_port}/metrics"
            ).read()
            assert b"tandem_decode_engine_up 0.0" in scrape
            assert _health(server) == health.NOT_SERVING  # Kubernetes takes it out
        finally:
            sender.agent.close()
