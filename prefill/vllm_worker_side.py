"""The connector's worker side (one per vLLM tensor-parallel rank): sends its KV heads of each
ticketed request into the decode server's blocks, layer by layer, through the KvSender
(prefill/kv_sender.py: Hello, connect, posting, deadline and commit are its job). What is vLLM's
is here: its cache layouts, and staging. An MLA model's layers hold one latent plane, which
every rank holds whole: one rank sends it (LATENT_SENDER_RANK).

A request's life here:
  bind, with its first SendPlan -> a sender session opens (connecting in the background)
  -> save_layer, for each layer of each step with a plan: the plan's tokens of that layer are
     gathered from vLLM's cache into staging slots, converted to the decode layout (HND, the
     decode server's block size; a latent in its row order, fp8 dequantized), and handed to
     the sender
  -> step_done after its final plan: the sender commits once every write has ended.
A plan's error (the request ended before its prompt was prefilled) fails the session: the
decode server fails the request with that reason and never decodes wrong KV.

Everything vLLM's blocks hold is copied into staging within save_layer, so vLLM may free or
reuse the blocks as soon as a step ends. A slot is reused once its writes have ended; a slot
held by a session still connecting fails that session instead of stalling vLLM's forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from prefill.kv_sender import KvSender, kv_written
from prefill.kv_writes import BlockLayout, LayerKV, gather_blocks, layer_ops
from prefill.send_session import SendSession, SessionState, Target
from prefill.ticket import (
    KV_FORMAT_HND,
    KV_FORMAT_MLA_LATENT,
    KvTransfer,
    SpeculativeKv,
    dtype_name,
    kv_dtype_fields,
    layout_descriptor,
    rank_heads,
)
from prefill.vllm_config import TandemConnectorConfig
from prefill.vllm_layouts import (
    FP8_CACHE_DTYPES,
    LAYOUT_VERSION,
    CacheViews,
    cache_views,
    dense_kv_fields,
    latent_views,
)
from prefill.vllm_metadata import SendPlan, TandemMetadata
from prefill.vllm_staging import StagingRing
from proto.tandem.v1 import decode_pb2
from transport.base import Transport, WriteOp

logger = logging.getLogger(__name__)

STAGING_STALL_S = 1.0
"""How long vLLM's forward may wait for a session's connect when staging memory runs out: a
decode server that answers takes milliseconds; one that does not must not stall the engine."""


LATENT_SENDER_RANK = 0
"""The tensor-parallel rank that sends an MLA model's KV. NOTE: the latent has no heads to split,
so every rank holds all of it; the decode server wants each layer written once and every layer
committed by each sender the ticket names. So one rank sends every layer and commits, and the
others send nothing (`num_senders`)."""


def num_senders(kv_format: str, tp_size: int) -> int:
    """Sender ranks that a ticket for vLLM must name: every rank for per-head K and V (each
    sends the heads it holds), one for an MLA latent."""
    return 1 if kv_format == KV_FORMAT_MLA_LATENT else tp_size


@dataclass(frozen=True)
class WorkerFacts:
    """What the worker side knows of vLLM's configuration."""

    model_name: str
    num_kv_heads: int
    """KV heads of the whole model; 1 for an MLA latent."""
    head_dim: int
    """Elements of one head; of one latent row (kv_lora_rank + qk_rope_head_dim) for MLA."""
    block_size: int
    """Tokens per block id of a SendPlan (vLLM's scheduler block size)."""
    tp_rank: int
    tp_size: int
    kv_format: str = KV_FORMAT_HND
    """What a layer caches, as the descriptor names it: "hnd" (K and V) or "mla-latent"."""
    kv_lora_rank: int = 0
    """MLA: the latent's c_kv channels; k_pe (RoPE) is the rest of head_dim."""

    def __post_init__(self) -> None:
        if self.kv_format not in (KV_FORMAT_HND, KV_FORMAT_MLA_LATENT):
            raise ValueError(f"kv_format: {self.kv_format!r} is neither hnd nor mla-latent")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: an MLA latent is one head, not {self.num_kv_heads}")
        rope_dim = self.head_dim - self.kv_lora_rank
        if self.latent and not (0 < self.kv_lora_rank < self.head_dim and rope_dim % 2 == 0):
            raise ValueError(
                f"kv_lora_rank: {self.kv_lora_rank} must leave an even k_pe in a latent of "
                f"{self.head_dim}"
            )
        if not self.latent:
            rank_heads(self.num_kv_heads, self.tp_size, self.tp_rank)  # uneven heads: refused now

    @property
    def latent(self) -> bool:
        return self.kv_format == KV_FORMAT_MLA_LATENT

    @property
    def sends(self) -> bool:
        """Whether this rank sends KV at all."""
        return not self.latent or self.tp_rank == LATENT_SENDER_RANK

    @property
    def num_senders(self) -> int:
        return num_senders(self.kv_format, self.tp_size)

    @property
    def heads(self) -> range:
        """The model's KV heads this rank sends (the latent's one head)."""
        if self.latent:
            return range(1)
        return rank_heads(self.num_kv_heads, self.tp_size, self.tp_rank)


@dataclass(frozen=True)
class ProposerLayers:
    """vLLM's speculative proposer's own layers (a draft model's, a model's MTP layers), which
    the decode server's proposer of the same method needs for the prompt: sent after the
    model's layers (LayoutDescriptor.speculative_kv). vLLM writes them in the same step as the
    model's, before `wait_for_save`: a draft model the prompt's tokens at their positions, an
    MTP layer position j with token j + 1 (the last with the sampled token)."""

    method: str
    """vLLM's speculative method, the decode server's: "draft_model" or "mtp"."""
    names: list[str]
    views: list[CacheViews]
    kv_format: str
    num_kv_heads: int
    head_dim: int
    """Of one head as sent (an MLA latent: one head of the latent width)."""

    def describe(self) -> SpeculativeKv:
        return SpeculativeKv(
            self.method, self.kv_format, len(self.views), self.num_kv_heads, self.head_dim,
            dtype_name(self.views[0].dtype),
        )  # fmt: skip


class WorkerSide:
    def __init__(self, config: TandemConnectorConfig, facts: WorkerFacts, agent: Transport):
        self.config = config
        self.facts = facts
        self.agent = agent
        self.sender: KvSender | None = None
        """Once the caches are registered (the sender's Hello carries their layout); stays None
        on a rank that sends nothing (`WorkerFacts.sends`)."""
        self._views: list[CacheViews] = []
        """The model's layers', then the proposer's."""
        self._layer_of: dict[str, int] = {}
        self._num_model_layers = 0
        self._proposer: ProposerLayers | None = None
        self._saved: set[int] = set()
        """Layers sent in this step: a proposer's layer that runs again for a further draft
        (MTP at depth > 1) writes only the new draft's rows, which are not sent."""
        self._split = 1
        self._ring: StagingRing | None = None
        self._sessions: dict[str, SendSession] = {}
        self._step: list[tuple[SendPlan, SendSession]] = []

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def register(
        self,
        layers: list[tuple[str, torch.Tensor]],
        backend: str,
        cpu_layout: str = "vllm-cpu",
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[float, float] = (1.0, 1.0),
        proposer: ProposerLayers | None = None,
    ) -> None:
        """vLLM's per-layer cache tensors of the model, in layer order, its attention backend's
        name and, on CPU, which of its layouts the caches have (vllm_layouts.detect_cpu_layout);
        its layers' KV cache dtype (vLLM's Attention.kv_cache_dtype) and, for an fp8 cache,
        their (k_scale, v_scale) (an MLA cache's: its k_scale twice); the speculative proposer's
        layers, if sent."""
        if not self.facts.sends:
            return
        heads, head_dim = len(self.facts.heads), self.facts.head_dim
        if self.facts.latent:
            rank, rope_dim = self.facts.kv_lora_rank, head_dim - self.facts.kv_lora_rank
            self._views = [
                latent_views(backend, t, rank, rope_dim, kv_cache_dtype) for _, t in layers
            ]
        else:
            self._views = [cache_views(backend, t, heads, head_dim, cpu_layout) for _, t in layers]
        self._layer_of = {name: i for i, (name, _) in enumerate(layers)}
        self._num_model_layers = len(layers)
        self._proposer = proposer
        if proposer is not None:
            first = len(layers)
            self._layer_of |= {name: first + i for i, name in enumerate(proposer.names)}
            self._views += proposer.views
        k, dtype = self._views[0].k, self._views[0].dtype
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
        if self.facts.latent and kv_cache_dtype not in FP8_CACHE_DTYPES:
            kv_fields = kv_dtype_fields(dtype, 0.0)  # fp8_ds_mla's rows are sent dequantized
        else:
            kv_fields = dense_kv_fields(kv_cache_dtype, layers[0][1], *kv_scales)
        layout = layout_descriptor(
            model_name=self.facts.model_name, num_layers=len(layers),
            num_kv_heads=self.facts.num_kv_heads, head_dim=head_dim,
            **kv_fields, block_size=kernel_block_size,
            layout=self._views[0].layout, layout_version=LAYOUT_VERSION,
            tp_size=self.facts.num_senders, transport=self.config.transport,
            kv_format=self.facts.kv_format,
            speculative_kv="" if proposer is None else str(proposer.describe()),
        )  # fmt: skip
        self.sender = KvSender(
            self.agent, layout, sender_id=f"vllm-rank{self.facts.tp_rank}",
            rank=self.facts.tp_rank, heads=self.facts.heads,
            token_bytes=head_dim * dtype.itemsize, timeout_s=self.config.transfer_timeout_s,
        )  # fmt: skip

    def bind(self, meta: TandemMetadata) -> None:
        """Before a step's forward: the step's plans; new requests open a sender session."""
        self._step, self._saved = [], set()
        if self.sender is None:
            return  # a rank that sends nothing
        for plan in meta.plans:
            session = self._sessions.get(plan.req_id)
            if session is None:
                session = self._sessions[plan.req_id] = self._open(plan)
            elif plan.error:
                self.sender.fail(session, plan.error)
            session.src_blocks = [
                b * self._split + i for b in plan.block_ids for i in range(self._split)
            ]
            self._step.append((plan, session))

    def save_layer(self, layer_name: str) -> None:
        """Right after vLLM wrote this layer's KV of the step: stage it and hand it over."""
        layer = self._layer_of.get(layer_name)
        if layer is None or layer in self._saved:
            return
        self._saved.add(layer)
        for plan, session in self._step:
            if session.state is not SessionState.FAILED and plan.end > plan.start:
                self._send(session, layer, plan.start, plan.end)

    def step_done(self) -> None:
        """After the step's forward (and the drafter's): requests whose prompt is complete are
        committed once their writes have ended."""
        unsent = self._proposer_layers_unsaved()
        for plan, session in self._step:
            if unsent and plan.end > plan.start:
                # vLLM skips its drafter for a step whose sequences do not fit the draft
                # model's context: the decode would lack the proposer's KV of these tokens.
                why = (f"vLLM's speculative drafter wrote none of its layers {unsent} in this step "
                       "(does the prompt fit the draft model's max_model_len?)")  # fmt: skip
                self.sender.fail(session, why)
        for plan, session in self._step:
            if plan.final:
                self.sender.finish(session).add_done_callback(partial(_log_failure, session))
                del self._sessions[plan.req_id]
        self._step = []

    def _proposer_layers_unsaved(self) -> list[int]:
        """The proposer's layers (numbered after the model's) this step did not save."""
        if self._proposer is None or self.sender is None:
            return []
        first = self._num_model_layers
        layers = range(first, first + len(self._proposer.views))
        return [layer for layer in layers if layer not in self._saved]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.agent.close()

    def _open(self, plan: SendPlan) -> SendSession:
        assert plan.ticket, f"{plan.req_id}: first plan without a ticket"
        transfer = KvTransfer(decode_pb2.Ticket.FromString(plan.ticket), plan.decode_address)
        return self.sender.open(transfer, plan.error or self._staging_problem(transfer.ticket))

    def _staging_problem(self, ticket: decode_pb2.Ticket) -> str:
        planes = len(self._views[0].planes)
        block = planes * len(self.facts.heads) * ticket.layout.block_size * self.sender.token_bytes
        spec = self.sender.speculative
        if spec is not None:
            spec_block = spec.planes * spec.num_heads * ticket.layout.block_size * spec.token_bytes
            block = max(block, spec_block)
        if self._ring.slot_bytes < block:
            return (
                f"staging_mb: a slot of {self._ring.slot_bytes} bytes cannot hold one decode "
                f"block of {'K and V' if planes == 2 else 'the latent'} ({block} bytes)"
            )
        return ""

    def _send(self, session: SendSession, layer: int, start: int, end: int) -> None:
        """Tokens [start, end) of one layer, from the decode block holding `start` on (rows
        before `start` in that block are sent again: their values are already there)."""
        views, dst = self._views[layer], session.dst_layout
        proposer = layer >= self._num_model_layers
        if proposer:
            dst = session.proposer_dst_layout
        planes, heads, block_size = len(views.planes), views.k.shape[1], dst.block_size
        head_dim = dst.token_stride // views.dtype.itemsize
        block_bytes = heads * block_size * dst.token_stride
        staging = BlockLayout(block_size, block_bytes, block_size * dst.token_stride,
                              dst.token_stride)  # fmt: skip
        per_slot = self._ring.slot_bytes // (planes * block_bytes) * block_size
        num_tokens = session.ticket.num_tokens
        for first in range(start // block_size * block_size, end, per_slot):
            last = min(end, first + per_slot)
            count = -(-(last - first) // block_size)
            slot, slot_posts = self._ring.take(self._stalled)
            stage = slot[: planes * count * block_bytes].view(views.dtype)
            stage = stage.view(planes, count, heads, block_size, head_dim)
            for plane, out in zip(views.planes, stage, strict=True):
                gather_blocks(plane, session.src_blocks, first, last, out, views.convert)
            ready = kv_written() if stage.is_cuda else None
            run = _StagedRun(
                LayerKV(*(out.data_ptr() for out in stage)), staging, dst,
                layer - self._num_model_layers if proposer else layer,
                session.ticket.block_ids[first // block_size :][:count], last - first,
                pad_tail=last == num_tokens, proposer_heads=range(heads) if proposer else None,
            )  # fmt: skip
            done = layer if last == num_tokens else None
            slot_posts.append((session, self.sender.post(session, run.ops, ready, done)))

    def _stalled(self, session: SendSession) -> None:
        """A slot is wanted back while its writes still wait for their session's connect."""
        if not session.connected.wait(STAGING_STALL_S):
            self.sender.fail(
                session,
                f"its decode server did not answer within {STAGING_STALL_S} s, and staging "
                "memory ran out",
            )


@dataclass(frozen=True)
class _StagedRun:
    """One layer's K and V (or latent) of a run of tokens, in staging as whole decode blocks."""

    src: LayerKV
    staging: BlockLayout
    dst: BlockLayout
    layer: int
    dst_blocks: list[int]
    num_tokens: int
    pad_tail: bool
    proposer_heads: range | None = None
    """A speculative proposer's layer (`layer` indexes its layers): all of its heads, to the
    shard that lists its layers (the proposer runs on one rank)."""

    def ops(self, target: Target) -> list[WriteOp]:
        heads, offset = target.heads, target.dst_head_offset
        if self.proposer_heads is None:
            regions = target.shard.layers[self.layer]
        elif (regions := target.proposer_layer(self.layer)) is not None:
            heads, offset = self.proposer_heads, 0
        else:
            return []
        dst = LayerKV(regions.k.addr, regions.v.addr if regions.HasField("v") else None)
        return layer_ops(
            self.src, dst, self.staging, self.dst,
            range(len(self.dst_blocks)), self.dst_blocks, self.num_tokens, heads, offset,
            pad_tail=self.pad_tail,
        )  # fmt: skip


def _log_failure(session: SendSession, committed) -> None:
    stats = committed.result()
    if stats.error:
        logger.error("tandem ticket %s: %s", session.ticket.request_id, stats.error)
