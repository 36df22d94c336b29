"""The decode server's layout descriptor, and the Hello check of a sender's against it."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from proto.tandem.v1 import layout_pb2

LAYOUT_NAME = "HND"
LAYOUT_VERSION = 1
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def decode_layout(
    config: ModelConfig, name: str, block_size: int, dtype: torch.dtype, transport: str
) -> layout_pb2.LayoutDescriptor:
    """One rank holding every KV head, K and V per layer as [blocks, heads, block_size, dim]."""
    return layout_pb2.LayoutDescriptor(
        model=layout_pb2.ModelFingerprint(
            name=name,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            kv_dtype=_DTYPE_NAMES[dtype],
        ),
        block_size=block_size,
        layout=LAYOUT_NAME,
        layout_version=LAYOUT_VERSION,
        tp_size=1,
        head_ranges=[layout_pb2.HeadRange(start=0, end=config.num_kv_heads)],
        transport=transport,
    )


def mismatch(ours: layout_pb2.LayoutDescriptor, theirs: layout_pb2.LayoutDescriptor) -> str | None:
    """Why a sender with layout `theirs` cannot write into ours, naming both values; None if it
    can. Block size, layout name and TP split may differ: converting is the sender's job."""
    problems = []
    for field in ("num_layers", "num_kv_heads", "head_dim", "kv_dtype"):
        a, b = getattr(ours.model, field), getattr(theirs.model, field)
        if a != b:
            problems.append(f"{field}: decode has {a!r}, sender has {b!r}")
    if ours.transport != theirs.transport:
        problems.append(
            f"transport: decode uses {ours.transport!r}, sender uses {theirs.transport!r}"
        )
    covered = sorted((r.start, r.end) for r in theirs.head_ranges)
    heads = theirs.model.num_kv_heads
    if theirs.tp_size != len(covered) or not _tiles(covered, heads):
        problems.append(
            f"head_ranges: sender's {covered} (tp_size {theirs.tp_size}) do not split "
            f"[0, {heads}) into one range per rank"
        )
    return "; ".join(problems) or None


def _tiles(ranges: list[tuple[int, int]], heads: int) -> bool:
    position = 0
    for start, end in ranges:
        if start != position or end <= start:
            return False
        position = end
    return position == heads
