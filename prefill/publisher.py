"""Sends each layer's KV as soon as that layer is computed.

`KV_SEND_MODES` say which forwards send: by default the one that completes a prompt sends every
layer of the whole prompt; "chunkwise", every forward of a prompt prefilled in chunks sends the
blocks it filled whole (the last one the rest), so that only the last chunk's KV is left to move
after the prompt's last layer.

`KvPublisher` wraps the model's attention backend (engine.attention's `write_kv`, or for an MLA
model engine.mla's `store_latent`): when layer l's KV of a step (K and V, or the latent rows) has
been written into the local cache, every armed `LayerwiseSend` (a request whose prompt completes
in this step) hands the writes of layer l to the KvSender (prefill/kv_sender.py), so layer l
moves while layers l+1... compute.

On CUDA the writes must not start before the kernels that fill layer l have run: each layer
records an event, which the sender's poster thread waits for before posting.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.kv_cache import KVCache
from engine.mla import LatentBackend
from prefill.kv_sender import KvSender, kv_written
from prefill.kv_writes import BlockLayout, LayerKV, layer_ops
from prefill.send_session import SendSession, Target
from transport.base import WriteOp

KV_SEND_MODES = ("layerwise", "chunkwise", "after-forward")
"""layerwise: each layer, as the forward that completes the prompt computes it, for the whole
prompt. chunkwise: also each earlier chunk's forward, layer by layer, for the blocks it filled
whole (NOTE: on a CPU engine a transport that copies with the CPU then competes with the next
chunk's compute: measured slower on 2 cores). after-forward: every layer after the forward that
completes the prompt (to measure what sending layer by layer buys)."""


GROUP_BYTES = 64 * 2**20
"""A forward's computed layers are posted together until they hold this many bytes of the
request's KV, or the forward's last layer is written. Each post wakes the poster thread, whose
Python then competes with the forward's kernel launches for the interpreter (measured on one
H100, a 1k-token prompt of the Llama-3-8B shape: 32 posts, one a layer, slowed its 47 ms forward
by 14 ms). So a short prompt goes in a few posts, a long one still layer by layer, and what is
left to move after the last layer stays near 64 MiB: well under a millisecond over NVLink."""


class LayerwiseSend:
    """One request's KV from this engine's cache: each layer, once computed, posted whole (all
    of the request's blocks, every head, every plane) through the KvSender, a few layers a post
    where they are small (GROUP_BYTES); then, where the engine speculates with a cache of its
    own (a draft model, MTP layers), that cache's layers of the prompt, as layers num_layers..
    of the send."""

    def __init__(
        self,
        sender: KvSender,
        session: SendSession,
        kv_cache: KVCache,
        proposer_cache: KVCache | None = None,
    ) -> None:
        self.sender = sender
        self.session = session
        self.kv_cache = kv_cache
        self.proposer_cache = proposer_cache
        self.src_layout = _block_layout(kv_cache)
        planes = kv_cache.kv_caches[0]
        self._token_bytes = sum(p[0].numel() * p.element_size() for p in planes)
        self._token_bytes //= kv_cache.block_size
        """One token's KV in one layer, every plane and head of this cache."""
        self._computed: list[int] = []
        """Layers of the forward written but not posted yet (GROUP_BYTES)."""
        self.sent = session.ticket.num_cached_tokens
        """Tokens of the prompt whose writes are posted, or armed for the next forward (or in
        the decode server's prefix cache already)."""
        self.complete = False
        """Armed for the forward that completes the prompt: everything is sent by then."""
        self.held: list[int] = []
        """The engine's blocks it holds for the writes (the adapter's to take and release)."""
        self._piece: tuple[int, int, list[int]] = (0, 0, [])
        self._first_layer_ops: dict[tuple[int, int, int], tuple[int, list[WriteOp]]] = {}
        """(piece start, end, target) -> the first layer posted and its writes: the poster's
        own, so that the other layers' writes are that layer's, moved (see _ops)."""

    def arm(self, blocks: list[int], end: int, final: bool) -> bool:
        """Before a forward after which tokens [0, end) of the prompt are computed, in `blocks`
        (the sequence's, in token order): its layers will post tokens [sent, end), all the rest
        of the prompt if `final` (the forward completes it), else those of the blocks filled
        whole on both sides. False: nothing to post (nothing new, or complete already)."""
        if self.complete:
            return False
        if final:
            end = self.session.ticket.num_tokens
        else:
            end -= end % math.lcm(self.src_layout.block_size, self.session.dst_layout.block_size)
            if end <= self.sent:
                return False
        self.session.src_blocks = blocks
        self._piece = (self.sent, end, blocks)
        self._computed = []
        self.sent, self.complete = end, final
        return True

    def layer_ready(self, layer: int) -> None:
        """Called on the engine thread right after layer `layer`'s KV was written."""
        self._computed.append(layer)
        start, end, _ = self._piece
        last = layer == len(self.kv_cache.kv_caches) - 1
        if not last and len(self._computed) * (end - start) * self._token_bytes < GROUP_BYTES:
            return
        # One event after all of them: the poster may take the posts in any batches.
        written = self._written()
        for computed in self._computed:
            # The piece as armed now: the next forward may arm the next one before this posts.
            build = partial(self._ops, computed, *self._piece)
            done = computed if self.complete else None
            self.sender.post(self.session, build, written, completes_layer=done)
        self._computed = []

    def proposer_ready(self) -> None:
        """Called on the engine thread once the proposer's KV of the prompt was written
        (LLMEngine.fill_proposer); on a tensor-parallel rank without the proposer (it runs on
        rank 0 alone), when the prompt's send ends: its layers complete with no writes."""
        written, first = self._written(), len(self.kv_cache.kv_caches)
        if self.proposer_cache is None:
            self.session.writes_proposer = False
            for i in range(self.sender.speculative.num_layers):
                self.sender.post(self.session, _no_writes, None, completes_layer=first + i)
            return
        for i in range(len(self.proposer_cache.kv_caches)):
            ops = partial(self._proposer_ops, i)
            self.sender.post(self.session, ops, written, completes_layer=first + i)

    def _written(self) -> torch.cuda.Event | None:
        """CUDA: an event after the kernels queued so far, which the poster waits for."""
        return kv_written() if self.kv_cache.storage.is_cuda else None

    def _ops(
        self, layer: int, start: int, end: int, blocks: list[int], target: Target
    ) -> list[WriteOp]:
        """Layer `layer`'s writes of tokens [start, end). Every layer's planes sit at the same
        offsets from each other on both sides (one cache tensor each), so a piece's writes are
        built once, for the first layer posted, and moved by the layers' distance after: the
        poster's Python per layer is what sending costs the forward it runs beside."""
        key = (start, end, id(target))
        first = self._first_layer_ops.get(key)
        if first is not None:
            base, ops = first
            src = _layer_distance(self.kv_cache.kv_caches, base, layer)
            dst = _layer_distance(target.shard.layers, base, layer)
            if src is not None and dst is not None:
                return [WriteOp(op.src + src, op.dst + dst, op.nbytes) for op in ops]
        ops = self._layer_ops(
            self.kv_cache.kv_caches[layer], target.shard.layers[layer], self.src_layout,
            self.session.dst_layout, target.heads, target.dst_head_offset, blocks, start, end,
        )  # fmt: skip
        self._first_layer_ops.setdefault(key, (layer, ops))
        return ops

    def _proposer_ops(self, layer: int, target: Target) -> list[WriteOp]:
        regions = target.proposer_layer(layer)
        if regions is None:
            return []
        cache, session = self.proposer_cache, self.session
        return self._layer_ops(
            cache.kv_caches[layer], regions, _block_layout(cache), session.proposer_dst_layout,
            range(cache.storage.shape[3]), 0, session.src_blocks, session.ticket.num_cached_tokens,
            session.ticket.num_tokens,
        )  # fmt: skip

    def _layer_ops(
        self, planes, dst, src_layout, dst_layout, heads, dst_head_offset, blocks, start, end
    ):
        return layer_ops(
            LayerKV(*(plane.data_ptr() for plane in planes)),
            LayerKV(dst.k.addr, dst.v.addr if dst.HasField("v") else None),
            src_layout, dst_layout, blocks, list(self.session.ticket.block_ids), end, heads,
            dst_head_offset, start=start,
        )  # fmt: skip


def _layer_distance(layers, base: int, layer: int) -> int | None:
    """Bytes from layer `base`'s planes to layer `layer`'s, in a local cache's layers (tensors)
    or a ticket shard's (regions); None if the planes are not the same distance apart."""
    a, b = _plane_addresses(layers[base]), _plane_addresses(layers[layer])
    distance = b[0] - a[0]
    return distance if all(y - x == distance for x, y in zip(a, b, strict=True)) else None


def _plane_addresses(planes) -> list[int]:
    if isinstance(planes, tuple | list):
        return [plane.data_ptr() for plane in planes]
    return [planes.k.addr, planes.v.addr] if planes.HasField("v") else [planes.k.addr]


def _no_writes(target: Target) -> list[WriteOp]:
    return []


def _block_layout(cache: KVCache) -> BlockLayout:
    """A tandem cache's layout: [layer, plane, block, head, token, channel]."""
    token_bytes = cache.storage.shape[-1] * cache.storage.element_size()
    return BlockLayout(
        cache.block_size, cache.block_stride_bytes, cache.head_stride_bytes, token_bytes
    )


class KvPublisher:
    """An attention backend (or, for an MLA model, a latent backend: engine.mla's
    `store_latent`) that forwards to `inner` and, after each layer's KV write, tells the armed
    sessions that this layer is ready; with `kv_send` "after-forward", tells them every layer
    once the forward is done instead."""

    def __init__(self, kv_send: str = "layerwise") -> None:
        assert kv_send in KV_SEND_MODES, kv_send
        self.kv_send = kv_send
        self.inner: AttentionBackend | None = None
        self.armed: list[LayerwiseSend] = []
        """Told each layer as the forward writes it."""
        self._after_forward: list[LayerwiseSend] = []
        self._layer_of: dict[int, int] = {}

    def arm(self, sends: list[LayerwiseSend], hooks: bool = True) -> bool:
        """Before a forward: `sends` post the layers it computes. Returns whether the forward
        must call the layers' hooks (run eagerly, not as a CUDA graph). `hooks` False: the
        forward may replay a graph (a decode-shaped step: each prompt's last token alone), so
        its layers are posted together once it is done; one token's KV is too little for
        sending it layer by layer to gain anything over the graph."""
        if self.kv_send == "after-forward" or not hooks:
            self._after_forward = sends
            return False
        self.armed = sends
        return bool(sends)

    def forward_done(self) -> None:
        """After the forward `arm` was for: disarms; "after-forward" sends post every layer."""
        for send in self._after_forward:
            for layer in range(len(self._layer_of)):
                send.layer_ready(layer)
        self.armed = self._after_forward = []

    def wrap(self, inner: AttentionBackend | LatentBackend) -> KvPublisher:
        """For LLMEngine.build(wrap_attention=...): forwards to `inner`."""
        self.inner = inner
        return self

    def bind(self, kv_cache: KVCache) -> None:
        """Learns each layer by the address of its first plane (K, or the latent)."""
        self._layer_of = {planes[0].data_ptr(): i for i, planes in enumerate(kv_cache.kv_caches)}

    def attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """The inner backend's two calls apart, so that the layer is announced between them."""
        self.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return self.paged_attention(q, k_cache, v_cache, meta, scale)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        self.inner.write_kv(k_cache, v_cache, k, v, slot_mapping)
        self._announce(k_cache)

    def store_latent(self, cache, kv_a, q_pe, norm_weight, eps, cos, sin, interleaved, slots):
        q_pe = self.inner.store_latent(
            cache, kv_a, q_pe, norm_weight, eps, cos, sin, interleaved, slots
        )
        self._announce(cache)
        return q_pe

    def decode_attention(self, q_nope, q_pe, cache, meta: AttentionMetadata, kv_b, scale: float):
        return self.inner.decode_attention(q_nope, q_pe, cache, meta, kv_b, scale)

    def _announce(self, first_plane: torch.Tensor) -> None:
        if self.armed:
            layer = self._layer_of[first_plane.data_ptr()]
            for session in self.armed:
                session.layer_ready(layer)

    def paged_attention(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return self.inner.paged_attention(q, k_cache, v_cache, meta, scale)
