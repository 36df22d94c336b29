"""The layout descriptor of a tandem engine's KV cache (engine/kv_cache.py), as tandem's prefill
and the decode server each describe theirs in Hello and in every ticket: the whole model's KV
heads (an MLA latent as one head of the latent width) split over the tensor-parallel ranks, and
the speculative proposer's cache, if it keeps one."""

from __future__ import annotations

from engine.engine_config import KV_SCALE, EngineConfig
from engine.model_loader import read_model_config
from engine.spec_build import proposer_cache_config
from engine.tensor_parallel import kv_replicas
from prefill.ticket import SpeculativeKv, dtype_name, kv_dtype_fields, layout_descriptor
from proto.tandem.v1 import layout_pb2


def engine_layout(
    config: EngineConfig, *, name: str, layout: str, transport: str
) -> layout_pb2.LayoutDescriptor:
    """`layout`: the memory layout's name (the decode server's DECODE_LAYOUT, the prefill's
    PREFILL_LAYOUT: the same bytes, named for their role)."""
    model = read_model_config(config)
    _, heads, channels = model.kv_planes
    tp = config.tensor_parallel_size
    spec = speculative_kv(config)
    return layout_descriptor(
        model_name=name, num_layers=model.num_layers, num_kv_heads=heads, head_dim=channels,
        **kv_dtype_fields(config.kv_dtype, KV_SCALE),
        block_size=config.block_size, layout=layout, transport=transport,
        kv_format=model.kv_format,
        # Distinct head ranges: a head on several ranks (an MLA latent on all) counts once, and
        # one rank of each sends it.
        tp_size=tp // kv_replicas(model, tp),
        speculative_kv="" if spec is None else str(spec),
    )  # fmt: skip


def speculative_kv(config: EngineConfig) -> SpeculativeKv | None:
    """The proposer's prompt KV as it travels (None: its proposer keeps no cache)."""
    extra = proposer_cache_config(config)
    if extra is None:
        return None
    _, heads, channels = extra.kv_planes
    method = config.speculative_config.method
    return SpeculativeKv(
        method, extra.kv_format, extra.num_layers, heads, channels, dtype_name(config.kv_dtype)
    )
