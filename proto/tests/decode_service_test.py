"""Round trip of every tandem.v1.DecodeService RPC through the generated stubs over real gRPC.

The servicer here is a small in-test implementation of the contract (not the decode server): it
checks that each message survives serialization field by field, that server streaming delivers
messages in order, and that status codes and messages reach the client.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

NUM_LAYERS = 3


def _layout(layout: str, transport: str = "tcp", num_layers: int = NUM_LAYERS):
    return layout_pb2.LayoutDescriptor(
        model=layout_pb2.ModelFingerprint(
            name="tiny", num_layers=num_layers, num_kv_heads=4, head_dim=64, kv_dtype="bfloat16"
        ),
        block_size=64,
        layout=layout,
        layout_version=1,
        tp_size=2,
        head_ranges=[layout_pb2.HeadRange(start=0, end=2), layout_pb2.HeadRange(start=2, end=4)],
        transport=transport,
    )


class _ContractServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Implements just enough of the contract to exercise each message and status path."""

    def __init__(self) -> None:
        self.decode_layout = _layout("HND")
        self.commits: list[decode_pb2.CommitRequest] = []
        self.aborted: list[str] = []

    def Hello(self, request, context):
        ours, theirs = self.decode_layout.model, request.sender_layout.model
        if ours.num_layers != theirs.num_layers:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"num_layers: decode has {ours.num_layers}, sender {request.sender_id} has "
                f"{theirs.num_layers}",
            )
        return decode_pb2.HelloResponse(
            decode_layout=self.decode_layout,
            endpoints=[layout_pb2.TransportEndpoint(transport="tcp", metadata=b"127.0.0.1:1")],
        )

    def Reserve(self, request, context):
        blocks = -(-len(request.prompt_token_ids) // 64)
        if blocks > 4:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"need {blocks} blocks, 4 free")
        region = layout_pb2.KvRegion(addr=1 << 40, nbytes=1 << 20, device_id=0, is_gpu=False)
        return decode_pb2.ReserveResponse(
            ticket=decode_pb2.Ticket(
                request_id=request.request_id,
                generation=7,
                num_tokens=len(request.prompt_token_ids),
                block_ids=list(range(10, 10 + blocks)),
                block_stride_bytes=4 * 64 * 64 * 2,
                head_stride_bytes=64 * 64 * 2,
                shards=[
                    decode_pb2.KvShard(
                        rank=0,
                        heads=layout_pb2.HeadRange(start=0, end=4),
                        endpoint=layout_pb2.TransportEndpoint(transport="tcp", metadata=b"x"),
                        layers=[layout_pb2.LayerRegions(k=region, v=region)] * NUM_LAYERS,
                    )
                ],
                layout=self.decode_layout,
                num_senders=request.num_senders,
                deadline_unix_ms=1_700_000_000_000,
            )
        )

    def Commit(self, request, context):
        if request.generation != 7:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale generation {request.generation} (live: 7)",
            )
        self.commits.append(request)
        return decode_pb2.CommitResponse(committed_senders=len(self.commits), expected_senders=2)

    def Generate(self, request, context):
        if request.sampling.HasField("top_k") and request.sampling.top_k > 1000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_k: 5000 exceeds 1000")
        tokens = [request.first_token_id + i for i in range(request.max_tokens)]
        chunks = [tokens[i : i + 2] for i in range(0, len(tokens), 2)] or [[]]
        for chunk in chunks[:-1]:
            yield decode_pb2.GenerateResponse(token_ids=chunk)
        yield decode_pb2.GenerateResponse(
            token_ids=chunks[-1],
            finish_reason=decode_pb2.FINISH_REASON_LENGTH,
            usage=decode_pb2.Usage(prompt_tokens=5, completion_tokens=len(tokens)),
        )

    def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return decode_pb2.AbortResponse(aborted=request.request_id == "live")

    def Stats(self, request, context):
        return decode_pb2.StatsResponse(
            kv_blocks_total=4,
            kv_blocks_free=3,
            kv_blocks_quarantined=1,
            running=2,
            waiting=1,
            reserved=1,
            outstanding_tokens=123,
            tokens_generated=1 << 40,
            layout=self.decode_layout,
        )


@pytest.fixture()
def service():
    servicer = _ContractServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, decode_pb2_grpc.DecodeServiceStub(channel)
    channel.close()
    server.stop(grace=None).wait()


def test_hello_returns_decode_layout(service):
    _, stub = service
    reply = stub.Hello(
        decode_pb2.HelloRequest(sender_layout=_layout("vllm-cpu"), sender_id="p0"), timeout=5
    )
    assert reply.decode_layout == _layout("HND")
    assert [e.metadata for e in reply.endpoints] == [b"127.0.0.1:1"]


def test_hello_mismatch_is_failed_precondition_naming_both_values(service):
    _, stub = service
    with pytest.raises(grpc.RpcError) as err:
        stub.Hello(
            decode_pb2.HelloRequest(
                sender_layout=_layout("vllm-cpu", num_layers=30), sender_id="p1"
            ),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "num_layers: decode has 3, sender p1 has 30"


def test_reserve_returns_ticket_with_per_layer_destinations(service):
    _, stub = service
    reply = stub.Reserve(
        decode_pb2.ReserveRequest(
            request_id="r1", prompt_token_ids=list(range(130)), num_senders=2, max_tokens=16
        ),
        timeout=5,
    )
    ticket = reply.ticket
    assert (ticket.request_id, ticket.generation, ticket.num_tokens) == ("r1", 7, 130)
    assert list(ticket.block_ids) == [10, 11, 12]
    assert len(ticket.shards) == 1 and len(ticket.shards[0].layers) == NUM_LAYERS
    assert ticket.shards[0].layers[2].k.addr == 1 << 40  # 64-bit addresses survive
    assert ticket.num_senders == 2 and ticket.deadline_unix_ms == 1_700_000_000_000


def test_reserve_beyond_capacity_is_resource_exhausted(service):
    _, stub = service
    with pytest.raises(grpc.RpcError) as err:
        stub.Reserve(decode_pb2.ReserveRequest(request_id="big", prompt_token_ids=[1] * 1000))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "need 16 blocks" in err.value.details()


def test_commit_records_rank_bytes_and_optional_checksum(service):
    servicer, stub = service
    first = stub.Commit(
        decode_pb2.CommitRequest(
            request_id="r1", generation=7, sender_rank=1, bytes_written=1 << 33, layers_written=3
        )
    )
    second = stub.Commit(
        decode_pb2.CommitRequest(request_id="r1", generation=7, sender_rank=0, crc32=0)
    )
    assert (first.committed_senders, second.committed_senders, second.expected_senders) == (1, 2, 2)
    assert servicer.commits[0].bytes_written == 1 << 33
    assert not servicer.commits[0].HasField("crc32")
    assert servicer.commits[1].HasField("crc32")  # an explicit 0 is distinguishable from unset


def test_stale_commit_is_failed_precondition(service):
    servicer, stub = service
    with pytest.raises(grpc.RpcError) as err:
        stub.Commit(decode_pb2.CommitRequest(request_id="r1", generation=6, sender_rank=0))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert servicer.commits == []


def test_generate_streams_tokens_in_order_then_finish_and_usage(service):
    _, stub = service
    stream = stub.Generate(
        decode_pb2.GenerateRequest(
            request_id="r1",
            generation=7,
            first_token_id=100,
            max_tokens=5,
            sampling=decode_pb2.SamplingParams(temperature=0.0, seed=3),
        ),
        timeout=5,
    )
    messages = list(stream)
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == [100, 101, 102, 103, 104]
    assert all(m.finish_reason == decode_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert messages[-1].finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 5


def test_generate_rejects_bad_sampling_with_invalid_argument(service):
    _, stub = service
    stream = stub.Generate(
        decode_pb2.GenerateRequest(
            request_id="r1", generation=7, sampling=decode_pb2.SamplingParams(top_k=5000)
        ),
        timeout=5,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "top_k: 5000 exceeds 1000"


def test_abort_reports_whether_a_live_request_matched(service):
    servicer, stub = service
    assert stub.Abort(decode_pb2.AbortRequest(request_id="live", reason="client gone")).aborted
    assert not stub.Abort(decode_pb2.AbortRequest(request_id="done")).aborted
    assert servicer.aborted == ["live", "done"]


def test_stats_round_trip(service):
    _, stub = service
    stats = stub.Stats(decode_pb2.StatsRequest(), timeout=5)
    assert (stats.kv_blocks_total, stats.kv_blocks_free, stats.kv_blocks_quarantined) == (4, 3, 1)
    assert (stats.running, stats.waiting, stats.reserved) == (2, 1, 1)
    assert stats.tokens_generated == 1 << 40
    assert stats.layout.layout == "HND"


def test_unset_optional_sampling_fields_are_distinguishable_from_zero():
    params = decode_pb2.SamplingParams.FromString(
        decode_pb2.SamplingParams(temperature=0.0).SerializeToString()
    )
    assert params.HasField("temperature") and params.temperature == 0.0
    assert not params.HasField("top_p")
