"""Where a decode server's KV cache lives, as its tickets list it: one KvShard per
tensor-parallel rank, with the rank's KV heads, the endpoint of the transport its cache is
registered with, and each layer's regions (rank 0's with the speculative proposer's layers,
when it keeps a cache of its own: speculation runs on one rank). A sender writes each of its
heads into the shard that holds it (prefill/kv_sender.py), whatever its own TP size.

Rank 0's cache is registered by the server itself; every other rank registers its own, in its
own process, with a transport of its own, and hands rank 0 its shard (`DecodeRankAgent`, which
engine.tp_workers runs in the rank)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.kv_cache import KVCache, LayerRegion
from engine.step_executor import StepExecutor
from engine.tensor_parallel import cache_heads
from proto.tandem.v1 import decode_pb2, layout_pb2
from transport.base import Transport
from transport.config import KvTransportConfig


def kv_shard(
    rank: int,
    heads: range,
    endpoint: layout_pb2.TransportEndpoint,
    kv_cache: KVCache,
    proposer_cache: KVCache | None = None,
) -> decode_pb2.KvShard:
    """Rank `rank`'s shard: its heads [start, stop) of the model's, its endpoint, its layers
    (and the speculative proposer's, whose cache is registered with the same endpoint)."""
    device = kv_cache.storage.device
    where = {"device_id": device.index or 0, "is_gpu": device.type == "cuda"}
    extra = [] if proposer_cache is None else proposer_cache.layer_regions()
    return decode_pb2.KvShard(
        rank=rank,
        heads=layout_pb2.HeadRange(start=heads.start, end=heads.stop),
        endpoint=endpoint,
        layers=[_layer_regions(region, where) for region in kv_cache.layer_regions()],
        speculative_layers=[_layer_regions(region, where) for region in extra],
    )


def ticket_destination(
    layout: layout_pb2.LayoutDescriptor,
    shards: list[decode_pb2.KvShard],
    kv_cache: KVCache,
    proposer_cache: KVCache | None = None,
    instance_id: str = "",
) -> decode_pb2.Ticket:
    """What every ticket of this server says of where its KV goes: the layout, the shards, the
    caches' strides and this server process's instance id (a reservation adds the request, its
    blocks and deadline)."""
    ticket = decode_pb2.Ticket(
        block_stride_bytes=kv_cache.block_stride_bytes,
        head_stride_bytes=kv_cache.head_stride_bytes,
        shards=shards,
        layout=layout,
        decode_instance_id=instance_id,
    )
    if proposer_cache is not None:
        ticket.speculative_block_stride_bytes = proposer_cache.block_stride_bytes
        ticket.speculative_head_stride_bytes = proposer_cache.head_stride_bytes
    return ticket


class DecodeRankAgent:
    """A rank > 0's agent (engine.tp_workers.RankAgent): its cache registered with a transport
    of its own, kept open while the rank lives; `ready` hands rank 0 its KvShard, serialized."""

    def __init__(self, kv: KvTransportConfig, model: ModelConfig, tp_size: int, rank: int):
        self.kv = kv
        self.heads = cache_heads(model, tp_size, rank)
        self.rank = rank
        self.transport: Transport | None = None

    def wrap_attention(self, backend):
        return backend

    def ready(self, executor: StepExecutor, store) -> bytes:
        cache = executor.kv_cache
        self.transport = self.kv.create_registered([cache.region()], str(cache.storage.device))
        endpoint = layout_pb2.TransportEndpoint(
            transport=self.kv.backend, metadata=self.transport.endpoint()
        )
        return kv_shard(self.rank, self.heads, endpoint, executor.kv_cache).SerializeToString()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _layer_regions(region: LayerRegion, where: dict) -> layout_pb2.LayerRegions:
    """K and V, or (an "mla-latent" cache) the latent as `k` and no `v`."""
    k = layout_pb2.KvRegion(addr=region.k_ptr, nbytes=region.nbytes, **where)
    if region.v_ptr is None:
        return layout_pb2.LayerRegions(k=k)
    v = layout_pb2.KvRegion(addr=region.v_ptr, nbytes=region.nbytes, **where)
    return layout_pb2.LayerRegions(k=k, v=v)
