"""Builders for tests of the decode service: the real DecodeServicer on a tiny engine with random
weights on the CPU, served over gRPC on 127.0.0.1; an in-process prefill; an engine whose thread
a test can hold at a step."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
import torch

from decode.admission import Admission
from decode.engine_loop import EngineLoop
from decode.kv_shards import kv_shard, ticket_destination
from decode.metrics import DecodeMetrics
from decode.service import DecodeServicer
from engine.engine_config import DTYPES
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from prefill.ticket import DECODE_LAYOUT, layout_descriptor
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

BLOCK, BLOCKS = 16, 24
TOKEN_BYTES = 512
"""KV bytes per token: 2 layers, K and V, 2 heads of 16 float32s."""
TINY = EngineConfig(
    model="random:tiny",  # 2 layers, 2 KV heads of 16 dims, a vocabulary of 256
    dtype="float32",
    block_size=BLOCK,
    kv_cache_gb=BLOCKS * BLOCK * TOKEN_BYTES / 2**30,
    max_num_batched_tokens=256,
)
NEW_TOKENS = 10
"""max_tokens of every reservation, and of a Generate that does not say."""


def layout(num_layers: int = 2, kv_dtype: str = "float32") -> layout_pb2.LayoutDescriptor:
    return layout_descriptor(
        model_name="tiny", num_layers=num_layers, num_kv_heads=2, head_dim=16, kv_dtype=kv_dtype,
        block_size=BLOCK, layout=DECODE_LAYOUT, transport="tcp",
    )  # fmt: skip


class GatedEngine(LLMEngine):
    """The tiny engine, whose thread a test can hold at its next step (`hold`, then `release`),
    or make fail there (`fail_with`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._open = threading.Event()
        self._open.set()
        self._held = threading.Event()
        self.fail_with: Exception | None = None

    def hold(self) -> None:
        """Returns once the engine thread waits at the start of a step."""
        self._held.clear()
        self._open.clear()
        assert self._held.wait(timeout=10)

    def release(self) -> None:
        self._open.set()

    def step(self, before_run=None):
        if not self._open.is_set():
            self._held.set()
            self._open.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return super().step(before_run)


class Prefill:
    """Plays the prefill: runs a prompt on an engine with the same weights and copies its KV
    into the ticket's blocks of the decode engine's cache, as a transport would."""

    def __init__(self, decode_engine: LLMEngine) -> None:
        self.engine = LLMEngine.build(TINY)
        self.decode_engine = decode_engine

    def write(self, ticket: decode_pb2.Ticket, prompt: list[int]) -> int:
        """Returns the first token."""
        seq = self.engine.add_request(
            ticket.request_id, prompt, SamplingParams(), StopConditions(max_tokens=2)
        )
        [out] = self.engine.step()
        src, dst = torch.tensor(seq.block_ids), torch.tensor(list(ticket.block_ids))
        pairs = zip(
            self.engine.kv_cache.kv_caches, self.decode_engine.kv_cache.kv_caches, strict=True
        )
        for (src_k, src_v), (dst_k, dst_v) in pairs:
            dst_k[dst], dst_v[dst] = src_k[src], src_v[src]
        self.engine.abort(ticket.request_id)
        return out.token_id

    def reference(self, prompt: list[int]) -> list[int]:
        [tokens] = self.engine.generate([prompt], SamplingParams(), StopConditions(NEW_TOKENS))
        return tokens


class Stack:
    """A DecodeServicer on a GatedEngine, served on 127.0.0.1 (port 0), and a client."""

    def __init__(self) -> None:
        self.engine = GatedEngine.build(TINY)
        model = self.engine.model_config
        assert model.kv_bytes_per_token(DTYPES[TINY.dtype]) == TOKEN_BYTES
        self.admission = Admission(
            self.engine.pool, BLOCK, model.num_layers, TOKEN_BYTES, self.engine.max_model_len
        )
        self.loop = EngineLoop(self.engine)
        endpoint = layout_pb2.TransportEndpoint(transport="tcp", metadata=b"127.0.0.1:1")
        shards = [kv_shard(0, range(model.num_kv_heads), endpoint, self.engine.kv_cache)]
        destination = ticket_destination(layout(), shards, self.engine.kv_cache)
        self.servicer = DecodeServicer(self.admission, self.loop, destination, DecodeMetrics({}))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.prefill = Prefill(self.engine)

    def close(self) -> None:
        self.engine.release()
        self.channel.close()
        self.server.stop(grace=None).wait()
        self.loop.stop()

    def reserve(self, request_id: str, prompt: list[int], **kwargs) -> decode_pb2.Ticket:
        request = decode_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, max_tokens=NEW_TOKENS, **kwargs
        )
        return self.stub.Reserve(request, timeout=10).ticket

    def commit(self, ticket: decode_pb2.Ticket) -> decode_pb2.CommitResponse:
        """The only sender's commit of all of the ticket's KV."""
        request = decode_pb2.CommitRequest(
            request_id=ticket.request_id,
            generation=ticket.generation,
            bytes_written=ticket.num_tokens * TOKEN_BYTES,
            layers_written=self.engine.model_config.num_layers,
        )
        return self.stub.Commit(request, timeout=10)

    def ready(self, request_id: str, prompt: list[int]) -> tuple[decode_pb2.Ticket, int]:
        """A ticket with its KV written and committed, and the first token."""
        ticket = self.reserve(request_id, prompt)
        first = self.prefill.write(ticket, prompt)
        self.commit(ticket)
        return ticket, first

    def generate_request(self, ticket, first: int, **kwargs) -> decode_pb2.GenerateRequest:
        kwargs.setdefault("max_tokens", NEW_TOKENS)
        return decode_pb2.GenerateRequest(
            request_id=ticket.request_id,
            generation=ticket.generation,
            first_token_id=first,
            **kwargs,
        )

    def generate(self, ticket, first: int, **kwargs):
        return self.stub.Generate(self.generate_request(ticket, first, **kwargs), timeout=30)

    def generate_directly(self, request) -> tuple[threading.Thread, Context, list]:
        """Calls Generate (not over gRPC) on a thread of its own: `out` gets its messages, or
        the Refused that ended it."""
        context, out = Context(), []

        def run() -> None:
            try:
                out.extend(self.servicer.Generate(request, context))
            except Refused as e:
                out.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        return thread, context, out

    def abort(self, request_id: str, **kwargs) -> bool:
        request = decode_pb2.AbortRequest(request_id=request_id, **kwargs)
        return self.stub.Abort(request, timeout=10).aborted

    def assert_empty(self) -> None:
        stats = self.stub.Stats(decode_pb2.StatsRequest(), timeout=10)
        assert stats.kv_blocks_free == stats.kv_blocks_total == BLOCKS
        assert (stats.kv_blocks_quarantined, stats.reserved) == (0, 0)
        assert (stats.running, stats.waiting, stats.outstanding_tokens) == (0, 0, 0)
        assert self.admission.num_live == 0


class Context:
    """What DecodeServicer uses of a grpc.ServicerContext, for calling it directly."""

    def __init__(self) -> None:
        self.handed_over = threading.Event()
        """Set when Generate registers its client-gone callback: after its hand-over."""

    def add_callback(self, callback) -> bool:
        self.handed_over.set()
        return True

    def abort(self, code: grpc.StatusCode, details: str):
        raise Refused(code, details)


class Refused(Exception):
    """What context.abort raises: (code, details)."""


def rpc_failure(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details of the RpcError `call()` raises."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()
