"""Sends each layer's KV as soon as that layer is computed.

`KvPublisher` wraps the model's attention backend: when layer l's K/V of a step have been
written into the local cache, every armed `SendSession` (a request whose prompt completes in
this step) posts the writes of layer l into its decode server's blocks, so layer l moves while
layers l+1... compute. `SendSession.finish()` waits for every write and reports what was sent.

On CUDA the writes must not start before the kernels that fill layer l have run: the session
records an event per layer and a sender thread posts each layer's writes once its event is done.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.kv_cache import KVCache
from prefill.kv_sender import BlockLayout, LayerKV, layer_ops
from proto.tandem.v1 import decode_pb2
from transport.base import Peer, Transfer, Transport, TransportError


@dataclass(frozen=True)
class SendStats:
    bytes_written: int
    layers: int
    seconds: float
    """From the first layer's writes to the last one's completion."""
    error: str = ""
    prepare_seconds: float = 0.0
    """Building the write descriptors, all layers (the sender thread's Python work)."""
    post_seconds: float = 0.0
    """Handing them to the transport, all layers."""
    write_ops: int = 0
    """Descriptors written, all layers, after coalescing."""


class SendSession:
    """One request's KV, from this engine's blocks to the ticket's."""

    def __init__(
        self,
        ticket: decode_pb2.Ticket,
        agent: Transport,
        peer: Peer,
        kv_cache: KVCache,
        deadline: float,
    ) -> None:
        self.ticket = ticket
        self.agent = agent
        self.peer = peer
        self.kv_cache = kv_cache
        self.deadline = deadline
        head_dim = kv_cache.storage.shape[-1]
        token_bytes = head_dim * kv_cache.storage.element_size()
        self.src_layout = BlockLayout(
            kv_cache.block_size, kv_cache.block_stride_bytes, kv_cache.head_stride_bytes,
            token_bytes,
        )  # fmt: skip
        self.dst_layout = BlockLayout(
            ticket.layout.block_size, ticket.block_stride_bytes, ticket.head_stride_bytes,
            token_bytes,
        )  # fmt: skip
        self.heads = range(kv_cache.storage.shape[3])
        self.src_blocks: list[int] = []
        self._transfers: list[Transfer] = []
        self._layers = 0
        self._prepare = self._post = 0.0
        self._ops = 0
        self._started: float | None = None
        self._error: str = ""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._post_loop, daemon=True)
        self._thread.start()

    def layer_ready(self, layer: int) -> None:
        """Called on the engine thread right after layer `layer`'s K/V were written."""
        event = None
        if self.kv_cache.storage.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._queue.put((layer, event))

    def finish(self) -> SendStats:
        """Waits for every layer's writes (by the ticket's deadline)."""
        self._queue.put(None)
        self._thread.join()
        for transfer in self._transfers:
            try:
                transfer.wait()
            except TransportError as e:
                self._error = self._error or str(e)
        seconds = time.monotonic() - self._started if self._started else 0.0
        num_tokens = self.ticket.num_tokens
        token_bytes = self.src_layout.token_stride
        nbytes = 2 * self._layers * num_tokens * len(self.heads) * token_bytes
        return SendStats(nbytes, self._layers, seconds, self._error, self._prepare, self._post,
                         self._ops)  # fmt: skip

    def _post_loop(self) -> None:
        shard = self.ticket.shards[0]
        k_caches = self.kv_cache.kv_caches
        while (item := self._queue.get()) is not None:
            layer, event = item
            if self._error:
                continue
            if event is not None:
                event.synchronize()
            if self._started is None:
                self._started = time.monotonic()
            k, v = k_caches[layer]
            dst = shard.layers[layer]
            preparing = time.monotonic()
            ops = layer_ops(
                LayerKV(k.data_ptr(), v.data_ptr()), LayerKV(dst.k.addr, dst.v.addr),
                self.src_layout, self.dst_layout, self.src_blocks, list(self.ticket.block_ids),
                self.ticket.num_tokens, self.heads,
            )  # fmt: skip
            posting = time.monotonic()
            try:
                self._transfers.append(self.agent.write(self.peer, ops, self.deadline))
                self._layers += 1
            except TransportError as e:
                self._error = str(e)
            self._prepare += posting - preparing
            self._post += time.monotonic() - posting
            self._ops += len(ops)


class KvPublisher:
    """An attention backend that forwards to `inner` and, after each layer's KV write, tells
    the armed sessions that this layer is ready."""

    def __init__(self) -> None:
        self.inner: AttentionBackend | None = None
        self.armed: list[SendSession] = []
        self._layer_of: dict[int, int] = {}

    def wrap(self, inner: AttentionBackend) -> KvPublisher:
        """For LLMEngine.build(wrap_attention=...): forwards to `inner`."""
        self.inner = inner
        return self

    def bind(self, kv_cache: KVCache) -> None:
        self._layer_of = {k.data_ptr(): i for i, (k, _) in enumerate(kv_cache.kv_caches)}

    def attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """The inner backend's two calls apart, so that the layer is announced between them."""
        self.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return self.paged_attention(q, k_cache, v_cache, meta, scale)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        self.inner.write_kv(k_cache, v_cache, k, v, slot_mapping)
        if self.armed:
            layer = self._layer_of[k_cache.data_ptr()]
            for session in self.armed:
                session.layer_ready(layer)

    def paged_attention(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return self.inner.paged_attention(q, k_cache, v_cache, meta, scale)
