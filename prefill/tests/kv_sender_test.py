"""KvSender alone, against a real transport and a stand-in decode service: what a session does
while its decode server has not answered, and how a refused Hello is remembered and retried."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

import transport
from prefill.kv_sender import KvSender
from prefill.kv_writes import BlockLayout, LayerKV, layer_ops
from prefill.send_session import SessionState
from prefill.tests.fake_decode import FakeDecode
from prefill.ticket import DECODE_LAYOUT, KvTransfer, layout_descriptor, parse_commit_notice
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

LAYERS, HEADS, DIM, BLOCK, TOKENS = 2, 2, 8, 4, 10


def _layout(kv_dtype: str = "float32") -> layout_pb2.LayoutDescriptor:
    return layout_descriptor(
        model_name="m", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, kv_dtype=kv_dtype,
        block_size=BLOCK, layout=DECODE_LAYOUT, transport="tcp",
    )  # fmt: skip


@pytest.fixture
def decode():
    """A destination cache [layer, K|V, block, head, token, dim] behind a TCP agent, and the
    stand-in decode service."""
    agent = transport.create("tcp")
    cache = torch.zeros(LAYERS, 2, 4, HEADS, BLOCK, DIM)
    agent.register(cache.data_ptr(), cache.numel() * 4)
    service = FakeDecode(_layout())
    server = grpc.server(ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield agent, cache, service, f"127.0.0.1:{port}"
    service.hello_gate.set()
    server.stop(None)
    agent.close()


class _Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def source():
    agent = transport.create("tcp")
    kv = torch.randn(LAYERS, 2, 4, HEADS, BLOCK, DIM)
    agent.register(kv.data_ptr(), kv.numel() * 4)
    yield agent, kv
    agent.close()


def _transfer(
    decode, request_id: str = "t", instance_id: str = "", by_notification: bool = False
) -> KvTransfer:
    agent, cache, _, address = decode
    regions = [
        layout_pb2.LayerRegions(
            k=layout_pb2.KvRegion(addr=cache[i, 0].data_ptr(), nbytes=cache[i, 0].numel() * 4),
            v=layout_pb2.KvRegion(addr=cache[i, 1].data_ptr(), nbytes=cache[i, 1].numel() * 4),
        )
        for i in range(LAYERS)
    ]
    endpoint = layout_pb2.TransportEndpoint(transport="tcp", metadata=agent.endpoint())
    ticket = decode_pb2.Ticket(
        request_id=request_id, generation=1, num_tokens=TOKENS, block_ids=[2, 0, 3],
        block_stride_bytes=cache.stride(2) * 4, head_stride_bytes=cache.stride(3) * 4,
        shards=[decode_pb2.KvShard(rank=0, heads=layout_pb2.HeadRange(start=0, end=HEADS),
                                   endpoint=endpoint, layers=regions)],
        layout=_layout(), num_senders=1, deadline_unix_ms=int((time.time() + 30) * 1000),
        decode_instance_id=instance_id, commit_by_notification=by_notification,
    )  # fmt: skip
    return KvTransfer(ticket, address)


def _sender(source, clock=time.monotonic, kv_dtype: str = "float32") -> KvSender:
    return KvSender(
        source[0], _layout(kv_dtype), sender_id="test", rank=0, heads=range(HEADS),
        token_bytes=DIM * 4, timeout_s=30.0, retry_after_s=5.0, clock=clock,
    )  # fmt: skip


def _layer(source, session, layer: int):
    kv = source[1]
    src = BlockLayout(BLOCK, kv.stride(2) * 4, kv.stride(3) * 4, DIM * 4)

    def build(target):
        dst = target.shard.layers[layer]
        return layer_ops(
            LayerKV(kv[layer, 0].data_ptr(), kv[layer, 1].data_ptr()),
            LayerKV(dst.k.addr, dst.v.addr), src, session.dst_layout, [0, 1, 2],
            list(session.ticket.block_ids), TOKENS, target.heads,
        )  # fmt: skip

    return build


def test_writes_handed_over_while_connecting_go_once_connected_in_full(decode, source):
    _, cache, service, _ = decode
    service.hello_gate.clear()  # the decode server has not answered yet
    sender = _sender(source)
    session = sender.open(_transfer(decode))
    posts = [sender.post(session, _layer(source, session, i), completes_layer=i) for i in (0, 1)]
    committed = sender.finish(session)
    time.sleep(0.1)
    assert session.state is SessionState.CONNECTING and not any(p.done() for p in posts)
    service.hello_gate.set()
    stats = committed.result(timeout=10)
    assert stats.error == "" and stats.layers == LAYERS
    kv = source[1]
    for t in range(TOKENS):  # token t: source block t // BLOCK, destination block_ids[...]
        want = kv[:, :, t // BLOCK, :, t % BLOCK]
        assert torch.equal(cache[:, :, [2, 0, 3][t // BLOCK], :, t % BLOCK], want), t
    (commit,) = service.commits
    assert (
        commit.layers_written == LAYERS
        and commit.bytes_written == 2 * LAYERS * TOKENS * HEADS * DIM * 4
    )
    sender.close()


def test_failing_a_session_still_connecting_lets_its_writes_go_and_commits_why(decode, source):
    _, cache, service, _ = decode
    service.hello_gate.clear()
    sender = _sender(source)
    session = sender.open(_transfer(decode))
    post = sender.post(session, _layer(source, session, 0), completes_layer=0)
    sender.fail(session, "the request ended")
    assert post.result(timeout=5) == []  # not waiting for the decode server any more
    committed = sender.finish(session)
    service.hello_gate.set()
    assert committed.result(timeout=10).error == "the request ended"
    assert service.commits[0].error == "the request ended" and not cache.any()
    sender.close()


def test_a_ticket_taking_notifications_gets_its_commit_as_one_after_the_writes(decode, source):
    """Where the ticket says so, a successful commit travels as the transport's notification to
    rank 0's agent, after every write landed, and no Commit RPC is made; a failed session
    still calls Commit, whose answer it needs."""
    agent, cache, service, _ = decode
    sender = _sender(source)
    session = sender.open(_transfer(decode, "n", by_notification=True))
    for layer in range(LAYERS):
        sender.post(session, _layer(source, session, layer), completes_layer=layer)
    stats = sender.finish(session).result(timeout=10)
    assert stats.error == "" and service.commits == []
    (notice,) = agent.notifications()
    commit = parse_commit_notice(notice)
    assert (commit.request_id, commit.generation, commit.layers_written, commit.error) == (
        "n",
        1,
        LAYERS,
        "",
    )
    assert commit.bytes_written == 2 * LAYERS * TOKENS * HEADS * DIM * 4 == stats.bytes_written
    assert torch.equal(cache[:, :, 2], source[1][:, :, 0])  # the writes were done before it

    failed = sender.open(_transfer(decode, "f", by_notification=True))
    sender.fail(failed, "the request ended")
    assert sender.finish(failed).result(timeout=10).error == "the request ended"
    assert [c.error for c in service.commits] == ["the request ended"]
    assert agent.notifications() == []
    sender.close()


def test_a_refused_hello_is_remembered_then_retried_after_the_back_off(decode, source):
    _, _, service, _ = decode
    clock = _Clock()
    sender = _sender(source, clock, kv_dtype="bfloat16")
    first = sender.finish(sender.open(_transfer(decode, "a"))).result(timeout=10)
    assert "kv_dtype: decode has 'float32', sender has 'bfloat16'" in first.error
    again = sender.finish(sender.open(_transfer(decode, "b"))).result(timeout=10)
    assert again.error == first.error and service.hellos == 1  # remembered, not asked again
    service.layout = _layout("bfloat16")  # the decode server restarted, configured to match
    clock.now += 5.0
    retried = sender.finish(sender.open(_transfer(decode, "c"))).result(timeout=10)
    assert service.hellos == 2 and "kv_dtype" not in retried.error
    sender.close()


def test_a_decode_server_restarted_on_its_address_is_asked_again_and_connected_afresh(
    decode, source
):
    """Tickets name the decode server's instance: while it stays the same, Hello and the
    transport peer are reused; a ticket of another instance at that address (a restart) gets
    a new Hello at once, whatever the old one answered, and a new connection."""
    _, _, service, _ = decode
    connects = []
    agent = source[0]
    connect = agent.connect
    agent.connect = lambda *args: connects.append(args) or connect(*args)
    sender = _sender(source)

    def send(request_id: str, instance_id: str):
        session = sender.open(_transfer(decode, request_id, instance_id))
        for layer in range(LAYERS):
            sender.post(session, _layer(source, session, layer), completes_layer=layer)
        return sender.finish(session).result(timeout=10)

    assert send("a", "one").error == "" and send("b", "one").error == ""
    assert (service.hellos, len(connects)) == (1, 1)
    assert send("c", "two").error == ""
    assert (service.hellos, len(connects)) == (2, 2)
    # A ticket the old instance issued, arriving late, fails at once and changes nothing.
    assert "restarted since it issued this ticket" in send("late", "one").error
    assert send("c2", "two").error == "" and (service.hellos, len(connects)) == (2, 2)
    # A refusal is remembered for its instance only: the restarted one is asked at once.
    service.layout = _layout("bfloat16")
    assert "kv_dtype" in send("d", "three").error
    service.layout = _layout()
    assert send("e", "four").error == "" and service.hellos == 4
    sender.close()


def _sending(decode, source):
    """A sender with one session connected, counting the descriptors of each transport write:
    (sender, session, descriptors a write)."""
    sender = _sender(source)
    session = sender.open(_transfer(decode))
    deadline = time.monotonic() + 10
    while session.state is SessionState.CONNECTING and time.monotonic() < deadline:
        time.sleep(0.01)
    writes, write = [], sender.agent.write
    sender.agent.write = lambda peer, ops, *rest: writes.append(len(ops)) or write(peer, ops, *rest)
    return sender, session, writes


def _hold_poster(sender, session, build, completes_layer=None):
    """Posts `build` and returns once the poster is inside it, held there (so that what is
    posted next queues up behind it) until the returned event is set: (post, release)."""
    building, released = threading.Event(), threading.Event()

    def held(target):
        building.set()
        released.wait(10)
        return build(target)

    post = sender.post(session, held, completes_layer=completes_layer)
    assert building.wait(10)
    return post, released


def test_posts_queued_behind_a_busy_poster_go_as_one_write(decode, source):
    cache = decode[1]
    sender, session, writes = _sending(decode, source)
    first, released = _hold_poster(sender, session, _layer(source, session, 0), completes_layer=0)
    behind = [sender.post(session, _layer(source, session, i), completes_layer=i) for i in (1, 0)]
    committed = sender.finish(session)
    released.set()
    stats = committed.result(timeout=10)
    assert stats.error == "" and stats.layers == LAYERS
    layer_ops = writes[0]
    assert writes == [layer_ops, 2 * layer_ops]  # layer 0, then layers 1 and 0 in one write
    assert behind[0].result() is behind[1].result() and first.result() is not behind[0].result()
    kv = source[1]
    for t in range(TOKENS):
        want = kv[:, :, t // BLOCK, :, t % BLOCK]
        assert torch.equal(cache[:, :, [2, 0, 3][t // BLOCK], :, t % BLOCK], want), t
    sender.close()


class _Pending:
    """A CUDA event's part the poster uses, for kernels still running until it is waited on."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_layers_written_under_one_event_go_as_one_write_before_it_completes(decode, source):
    """A group of layers (publisher.GROUP_BYTES) shares one event: queued behind the poster,
    they join one write although the event has not completed, and it is waited on first."""
    sender, session, writes = _sending(decode, source)
    _, released = _hold_poster(sender, session, lambda target: [])
    group, other = _Pending(), _Pending()
    posts = [sender.post(session, _layer(source, session, i), group, i) for i in (0, 1)]
    sender.post(session, _layer(source, session, 0), other)  # another event, not completed
    committed = sender.finish(session)
    released.set()
    assert committed.result(timeout=10).error == ""
    layer_ops = writes[-1]
    assert writes == [0, 2 * layer_ops, layer_ops]  # the group in one write, then the other
    assert posts[0].result() is posts[1].result() and group.waited and other.waited
    sender.close()


def test_writes_that_cannot_be_built_fail_their_session_and_the_poster_goes_on(decode, source):
    cache = decode[1]
    service = decode[2]
    sender = _sender(source)
    broken = sender.open(_transfer(decode, "broken"))

    def unbuildable(target):
        raise IndexError("layer 7 is not in the ticket")

    sender.post(broken, unbuildable, completes_layer=0)
    stats = sender.finish(broken).result(timeout=10)
    assert stats.error == (
        "KV send: cannot build the writes: IndexError: layer 7 is not in the ticket"
    )
    assert service.commits[-1].error == stats.error
    session = sender.open(_transfer(decode, "next"))
    for layer in range(LAYERS):
        sender.post(session, _layer(source, session, layer), completes_layer=layer)
    assert sender.finish(session).result(timeout=10).error == ""
    kv = source[1]
    for t in range(TOKENS):
        want = kv[:, :, t // BLOCK, :, t % BLOCK]
        assert torch.equal(cache[:, :, [2, 0, 3][t // BLOCK], :, t % BLOCK], want), t
    sender.close()
