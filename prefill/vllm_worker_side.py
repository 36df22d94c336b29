"""The connector's worker side (one per vLLM tensor-parallel rank): sends its KV heads of each
ticketed request into the decode server's blocks, layer by layer, and commits.

A request's life here (a _Session):
  bind, with its first SendPlan -> Hello with its decode server (once per server: the decode
    server compares layouts and refuses a mismatch by name), transport connect (once per
    endpoint)
  -> save_layer, for each layer of each step with a plan: the plan's tokens of that layer are
     gathered from vLLM's cache into staging slots, converted to the decode layout (HND, the
     decode server's block size), and their writes posted on the poster thread
  -> step_done after its final plan: once the poster has posted its last write, a committer
     waits for every write and sends Commit(bytes, layers), or Commit(error).
Any failure (Hello refused, ticket refused, a transport error) is committed as the ticket's
error: the decode server fails the request with that reason and never decodes wrong KV.

Everything vLLM's blocks hold is copied into staging within save_layer, so vLLM may free or
reuse the blocks as soon as a step ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from prefill.kv_sender import BlockLayout, LayerKV, gather_blocks, layer_ops, valid_bytes
from prefill.vllm_config import TandemConnectorConfig
from prefill.vllm_layouts import LAYOUT_VERSION, CacheViews, cache_views
from prefill.vllm_metadata import SendPlan, TandemMetadata
from prefill.vllm_staging import StagingRing
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2
from transport.base import Peer, Transport, TransportError, WriteOp

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class WorkerFacts:
    """What the worker side knows of vLLM's configuration."""

    model_name: str
    num_kv_heads: int
    """KV heads of the whole model."""
    head_dim: int
    block_size: int
    """Tokens per block id of a SendPlan (vLLM's scheduler block size)."""
    tp_rank: int
    tp_size: int

    def __post_init__(self) -> None:
        if self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size: {self.tp_size} does not divide the model's "
                f"{self.num_kv_heads} KV heads (replicated heads are not supported)"
            )

    @property
    def heads(self) -> range:
        """The model's KV heads this rank holds."""
        per_rank = self.num_kv_heads // self.tp_size
        return range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)


@dataclass(frozen=True)
class _Target:
    """Where this rank's heads go on one decode rank (one ticket shard)."""

    shard: decode_pb2.KvShard
    peer: Peer
    heads: range
    """Local head indices (0 = this rank's first head) the shard stores."""
    dst_head_offset: int


@dataclass
class _Session:
    ticket: decode_pb2.Ticket
    decode: _Decode
    deadline: float
    error: str = ""
    dst_layout: BlockLayout | None = None
    targets: list[_Target] = field(default_factory=list)
    src_blocks: list[int] = field(default_factory=list)
    writes: list[Future] = field(default_factory=list)
    layers_done: set[int] = field(default_factory=set)
    """Layers whose last prompt token has been posted."""


@dataclass(frozen=True)
class _Write:
    session: _Session
    peer: Peer
    ops: list[WriteOp]
    ready: torch.cuda.Event | None
    """Recorded after the gather into staging (CUDA): the write waits for it."""
    future: Future


class _Decode:
    """One decode server's gRPC; `accepted` once its Hello took this sender's layout."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.accepted = False

    def hello(self, layout: layout_pb2.LayoutDescriptor, sender_id: str) -> str:
        """ "" once accepted, else why not (a refusal names both sides' values)."""
        if not self.accepted:
            request = decode_pb2.HelloRequest(sender_layout=layout, sender_id=sender_id)
            try:
                self.stub.Hello(request, timeout=10)
            except grpc.RpcError as e:
                return f"decode server {self.address}: {e.details()}"
            self.accepted = True
        return ""


class WorkerSide:
    def __init__(self, config: TandemConnectorConfig, facts: WorkerFacts, agent: Transport):
        self.config = config
        self.facts = facts
        self.agent = agent
        self.layout: layout_pb2.LayoutDescriptor | None = None
        """This rank's layout descriptor, once the caches are registered."""
        self._views: list[CacheViews] = []
        self._layer_of: dict[str, int] = {}
        self._split = 1
        self._ring: StagingRing | None = None
        self._sessions: dict[str, _Session] = {}
        self._step: list[tuple[SendPlan, _Session]] = []
        self._decoders: dict[str, _Decode] = {}
        self._peers: dict[bytes, Peer] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._committer = ThreadPoolExecutor(2, thread_name_prefix="tandem-commit")
        self._poster = threading.Thread(target=self._post_loop, name="tandem-post", daemon=True)
        self._poster.start()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def register(
        self, layers: list[tuple[str, torch.Tensor]], backend: str, cpu_layout: str = "vllm-cpu"
    ) -> None:
        """vLLM's per-layer cache tensors, in layer order, its attention backend's name and, on
        CPU, which of its layouts the caches have (vllm_layouts.detect_cpu_layout)."""
        heads, head_dim = len(self.facts.heads), self.facts.head_dim
        self._views = [cache_views(backend, t, heads, head_dim, cpu_layout) for _, t in layers]
        self._layer_of = {name: i for i, (name, _) in enumerate(layers)}
        k = self._views[0].k
        kernel_block_size = self._views[0].block_size
        if self.facts.block_size % kernel_block_size:
            raise ValueError(
                f"vLLM block size {self.facts.block_size} is not a multiple of its attention "
                f"kernel's {kernel_block_size}"
            )
        # A scheduler block id b covers kernel blocks [b * split, (b + 1) * split).
        self._split = self.facts.block_size // kernel_block_size
        self._ring = StagingRing(
            self.agent, int(self.config.staging_mb * (1 << 20)), self.config.staging_slots,
            k.device,
        )  # fmt: skip
        self.layout = layout_pb2.LayoutDescriptor(
            model=layout_pb2.ModelFingerprint(
                name=self.facts.model_name,
                num_layers=len(layers),
                num_kv_heads=self.facts.num_kv_heads,
                head_dim=self.facts.head_dim,
                kv_dtype=_DTYPE_NAMES.get(k.dtype, str(k.dtype).removeprefix("torch.")),
            ),
            block_size=kernel_block_size,
            layout=self._views[0].layout,
            layout_version=LAYOUT_VERSION,
            tp_size=self.facts.tp_size,
            head_ranges=[
                layout_pb2.HeadRange(start=r * heads, end=(r + 1) * heads)
                for r in range(self.facts.tp_size)
            ],
            transport=self.config.transport,
        )

    def bind(self, meta: TandemMetadata) -> None:
        """Before a step's forward: the step's plans; new requests meet their decode server."""
        self._step = []
        for plan in meta.plans:
            session = self._sessions.get(plan.req_id)
            if session is None:
                session = self._sessions[plan.req_id] = self._open(plan)
            if plan.error and not session.error:
                session.error = plan.error
            session.src_blocks = [
                b * self._split + i for b in plan.block_ids for i in range(self._split)
            ]
            self._step.append((plan, session))

    def save_layer(self, layer_name: str) -> None:
        """Right after vLLM wrote this layer's KV of the step: stage and post its writes."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for plan, session in self._step:
            if not session.error and plan.end > plan.start:
                self._send(session, layer, plan.start, plan.end)

    def step_done(self) -> None:
        """After the step's forward: requests whose prompt is complete go to a committer."""
        for plan, session in self._step:
            if plan.final:
                self._queue.put(session)
                del self._sessions[plan.req_id]
        self._step = []

    def close(self) -> None:
        self._queue.put(None)
        self._poster.join(timeout=30)
        self._committer.shutdown(wait=True)
        for decode in self._decoders.values():
            decode.channel.close()
        self.agent.close()

    def _open(self, plan: SendPlan) -> _Session:
        assert plan.ticket, f"{plan.req_id}: first plan without a ticket"
        ticket = decode_pb2.Ticket.FromString(plan.ticket)
        decode = self._decoders.get(plan.decode_address)
        if decode is None:
            decode = self._decoders[plan.decode_address] = _Decode(plan.decode_address)
        left = min(self.config.transfer_timeout_s, ticket.deadline_unix_ms / 1000 - time.time())
        session = _Session(ticket, decode, time.monotonic() + left)
        sender_id = f"vllm-rank{self.facts.tp_rank}"
        session.error = plan.error or decode.hello(self.layout, sender_id) or self._connect(session)
        return session

    def _connect(self, session: _Session) -> str:
        """Destination layout and transport peers of a session; "" or why it cannot send."""
        ticket, k = session.ticket, self._views[0].k
        block_size, row = ticket.layout.block_size, self.facts.head_dim * k.element_size()
        if ticket.head_stride_bytes != block_size * row:
            return (
                f"ticket {ticket.request_id}: head stride {ticket.head_stride_bytes} bytes is not "
                f"one HND block ({block_size} tokens x {row} bytes)"
            )
        if len(ticket.block_ids) * block_size < ticket.num_tokens:
            return (
                f"ticket {ticket.request_id}: {len(ticket.block_ids)} blocks of {block_size} "
                f"tokens cannot hold {ticket.num_tokens} tokens"
            )
        if any(len(shard.layers) != len(self._views) for shard in ticket.shards):
            return f"ticket {ticket.request_id}: not {len(self._views)} layers in every shard"
        if self._ring.slot_bytes < 2 * k.shape[1] * block_size * row:
            return (
                f"staging_mb: a slot of {self._ring.slot_bytes} bytes cannot hold one decode "
                f"block of K and V ({2 * k.shape[1] * block_size * row} bytes)"
            )
        session.dst_layout = BlockLayout(
            block_size, ticket.block_stride_bytes, ticket.head_stride_bytes, row
        )
        mine = self.facts.heads
        for shard in ticket.shards:
            first, end = max(mine.start, shard.heads.start), min(mine.stop, shard.heads.end)
            if first >= end:
                continue
            endpoint = shard.endpoint.metadata
            peer = self._peers.get(endpoint)
            try:
                if peer is None or not peer.usable():  # e.g. a TCP connection that broke
                    self._peers[endpoint] = self.agent.connect(endpoint, session.deadline)
            except TransportError as e:
                return f"KV transport: {e}"
            local = range(first - mine.start, end - mine.start)
            offset = shard.heads.start - mine.start
            session.targets.append(_Target(shard, self._peers[endpoint], local, offset))
        return ""

    def _send(self, session: _Session, layer: int, start: int, end: int) -> None:
        """Tokens [start, end) of one layer, from the decode block holding `start` on (rows
        before `start` in that block are sent again: their values are already there)."""
        views, dst = self._views[layer], session.dst_layout
        heads, block_size = views.k.shape[1], dst.block_size
        block_bytes = heads * block_size * dst.token_stride
        staging = BlockLayout(block_size, block_bytes, block_size * dst.token_stride,
                              dst.token_stride)  # fmt: skip
        per_slot = self._ring.slot_bytes // (2 * block_bytes) * block_size
        num_tokens = session.ticket.num_tokens
        for first in range(start // block_size * block_size, end, per_slot):
            last = min(end, first + per_slot)
            count = -(-(last - first) // block_size)
            slot, slot_writes = self._ring.take()
            stage = slot[: 2 * count * block_bytes].view(views.k.dtype)
            stage = stage.view(2, count, heads, block_size, self.facts.head_dim)
            gather_blocks(views.k, session.src_blocks, first, last, stage[0])
            gather_blocks(views.v, session.src_blocks, first, last, stage[1])
            ready = None
            if stage.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            src = LayerKV(stage[0].data_ptr(), stage[1].data_ptr())
            dst_blocks = session.ticket.block_ids[first // block_size :][:count]
            for target in session.targets:
                regions = target.shard.layers[layer]
                ops = layer_ops(
                    src, LayerKV(regions.k.addr, regions.v.addr), staging, dst, range(count),
                    dst_blocks, last - first, target.heads, target.dst_head_offset,
                    pad_tail=last == num_tokens,
                )  # fmt: skip
                future = Future()
                slot_writes.append(future)
                session.writes.append(future)
                self._queue.put(_Write(session, target.peer, ops, ready, future))
        if end == num_tokens:
            session.layers_done.add(layer)

    def _post_loop(self) -> None:
        """Posts writes in order; a session arriving here has posted its last write."""
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Session):
                self._committer.submit(self._commit, item)
                continue
            transfer = None
            if item.ready is not None:
                item.ready.synchronize()
            if not item.session.error:
                try:
                    transfer = self.agent.write(item.peer, item.ops, item.session.deadline)
                except TransportError as e:
                    item.session.error = f"KV transport: {e}"
            item.future.set_result(transfer)

    def _commit(self, session: _Session) -> None:
        error = session.error
        for future in session.writes:
            transfer = future.result()
            try:
                if transfer is not None:
                    transfer.wait()
            except TransportError as e:
                error = error or f"KV transport: {e}"
        ticket = session.ticket
        layers = 0 if error else len(session.layers_done)
        heads = sum(len(t.heads) for t in session.targets)
        row = session.dst_layout.token_stride if session.dst_layout else 0
        request = decode_pb2.CommitRequest(
            request_id=ticket.request_id,
            generation=ticket.generation,
            sender_rank=self.facts.tp_rank,
            bytes_written=valid_bytes(ticket.num_tokens, heads, row, layers),
            layers_written=layers,
            error=error,
        )
        try:
            session.decode.stub.Commit(request, timeout=10)
        except grpc.RpcError as e:
            error = error or f"commit refused: {e.details()}"
        if error:
            logger.error("tandem ticket %s: %s", ticket.request_id, error)
