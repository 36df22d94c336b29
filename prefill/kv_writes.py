"""The write descriptors of the send path (prefill/kv_sender.py): one request's KV, layer by
layer, as one-sided writes into the decode server's blocks (a Ticket).

Both sides address KV as (layer, plane, block, head, token-in-block, head_dim), where a layer's
planes are K and V, or for an MLA model the one latent plane (one head of the latent width); a
`BlockLayout` gives the byte strides of one side, the same for every plane. With equal block
sizes and head-contiguous blocks (both "HND"), a block of all the sender's heads is one run and
adjacent blocks coalesce; otherwise the writes go per (head, run of tokens that stays inside one
block on both sides).

A sender whose cache has no token rows to copy from (vLLM's CPU cache stores K transposed, the
GPU FlashAttention cache interleaves heads per token) first gathers the request's tokens into
a staging buffer laid out as the destination's blocks (`gather_blocks`, from any strided view
[block, head, token, head_dim], or a tiled one: see `token_rows`); the writes then go from
staging, whole blocks at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_values import to_device
from transport.base import WriteOp


@dataclass(frozen=True)
class BlockLayout:
    """Byte strides of one layer's K, V or latent plane on one side."""

    block_size: int
    block_stride: int
    """Bytes from block b to b + 1."""
    head_stride: int
    """Bytes from head h to h + 1 inside a block."""
    token_stride: int
    """Bytes from one token to the next inside a block and head: head_dim * element size."""

    @property
    def head_block_bytes(self) -> int:
        return self.block_size * self.token_stride


@dataclass(frozen=True)
class LayerKV:
    """One layer's plane base addresses on one side: K and V, or the MLA latent as `k`."""

    k: int
    v: int | None = None
    """None: the layer's one plane is `k` (an "mla-latent" cache)."""

    @property
    def planes(self) -> tuple[int, ...]:
        return (self.k,) if self.v is None else (self.k, self.v)


def layer_ops(
    src: LayerKV,
    dst: LayerKV,
    src_layout: BlockLayout,
    dst_layout: BlockLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    num_tokens: int,
    heads: range,
    dst_head_offset: int = 0,
    pad_tail: bool = True,
    start: int = 0,
) -> list[WriteOp]:
    """Writes of tokens [start, num_tokens) of `heads` (sender head indices) for each plane of
    one layer (src and dst must have the same planes); the destination head is h -
    dst_head_offset. `start` is a multiple of both sides' block sizes (blocks the sequence's
    earlier writes filled whole).

    `pad_tail`: a partly filled last block may be written whole (its rows past num_tokens are
    the sequence's own and never read before they are rewritten). False when those rows belong
    to tokens a later write brings: this write must not race it with stale rows."""
    whole_blocks = (
        src_layout.block_size == dst_layout.block_size
        and src_layout.head_stride == src_layout.head_block_bytes
        and dst_layout.head_stride == dst_layout.head_block_bytes
    )
    full = num_tokens if pad_tail else num_tokens - num_tokens % dst_layout.block_size
    full = max(full, start)
    assert start % src_layout.block_size == 0 and start % dst_layout.block_size == 0, start
    assert len(src.planes) == len(dst.planes), (src, dst)
    ops = []
    for src_base, dst_base in zip(src.planes, dst.planes, strict=True):
        sides = (src_base, dst_base, src_layout, dst_layout, src_blocks, dst_blocks)
        if whole_blocks:
            ops += _block_runs(*sides, start, full, heads, dst_head_offset)
            ops += _token_runs(*sides, num_tokens, heads, dst_head_offset, start=full)
        else:
            ops += _token_runs(*sides, num_tokens, heads, dst_head_offset, start=start)
    return coalesce(ops)


def gather_blocks(
    view: torch.Tensor,
    src_blocks: Sequence[int],
    start: int,
    end: int,
    out: torch.Tensor,
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Copies tokens [start, end) of every head from `view` into `out`, the destination's
    blocks laid out "HND", token `start` at out[0, :, 0].

    view: one layer's K, V or latent on the sender, as `token_rows` takes it.
    src_blocks: the sequence's blocks in `view`, in token order.
    out: [n, num_heads, out_block_size, head_dim] with n * out_block_size >= end - start; rows
      past end - start are left as they are.
    convert: [T, num_heads, row] as read -> [T, num_heads, head_dim] as `out` holds them (e.g.
      fp8 rows with their scales, dequantized); None: copied as they are.
    """
    block_size = view_block_size(view)
    tokens = torch.arange(start, end, device=view.device)
    # Called between a forward's layers: a pageable copy would wait for the forward's kernels.
    blocks = to_device(src_blocks, view.device, torch.long)[tokens // block_size]
    rows = tokens - start
    out_block_size = out.shape[2]
    got = token_rows(view, blocks, tokens % block_size)
    out[rows // out_block_size, :, rows % out_block_size] = got if convert is None else convert(got)


def token_rows(view: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[T, num_heads, head_dim]: token `offsets[i]` of block `blocks[i]`, every head.

    view: [num_blocks, num_heads, block_size, head_dim], any strides (a transposed or
    interleaved cache is a strided view of its memory); or tiled, [num_blocks, num_heads,
    block_size / t, t, head_dim / d, d], token and dimension each split in two, with any strides
    (AMX tiles pack pairs of tokens or of dimensions together, so no 4-d view reads them).
    """
    # Advanced indices around a slice put the token dimension first.
    if view.dim() == 4:
        return view[blocks, :, offsets]
    tile = view.shape[3]
    rows = view[blocks, :, offsets // tile, offsets % tile]  # [T, heads, head_dim / d, d]
    return rows.reshape(*rows.shape[:2], -1)


def view_block_size(view: torch.Tensor) -> int:
    """Tokens a block of `view` (as `token_rows` takes it) holds."""
    return view.shape[2] * (view.shape[3] if view.dim() == 6 else 1)


def valid_bytes(
    num_tokens: int, num_heads: int, token_stride: int, num_layers: int, planes: int = 2
) -> int:
    """KV bytes of the prompt proper (what a commit reports): all layers, every plane (K and V,
    or the one latent)."""
    return planes * num_layers * num_tokens * num_heads * token_stride


def coalesce(ops: list[WriteOp]) -> list[WriteOp]:
    """Merges runs that continue each other on both sides: descriptor count, not bytes, bounds
    transfer time."""
    merged: list[WriteOp] = []
    for op in ops:
        if merged:
            last = merged[-1]
            if last.src + last.nbytes == op.src and last.dst + last.nbytes == op.dst:
                merged[-1] = WriteOp(last.src, last.dst, last.nbytes + op.nbytes)
                continue
        merged.append(op)
    return merged


def _block_runs(
    src_base,
    dst_base,
    src_layout,
    dst_layout,
    src_blocks,
    dst_blocks,
    start,
    num_tokens,
    heads,
    dst_head_offset,
) -> list[WriteOp]:
    """Same block size, head-contiguous blocks: each block's heads of tokens [start,
    num_tokens) in one run (the last block whole, padding rows included: they are the
    sequence's own and never read). Blocks that follow each other on both sides merge into one
    run, computed with numpy: an 8k-token prompt has 512 blocks per layer, and one Python object
    per block cost the sender ~0.5 ms a layer."""
    first, count = heads.start, len(heads)
    nbytes = count * src_layout.head_stride
    begin, end = start // src_layout.block_size, _blocks(num_tokens, src_layout)
    assert end == _blocks(num_tokens, dst_layout)
    n = end - begin
    if n <= 0:
        return []
    src = np.asarray(src_blocks[begin:end], dtype=np.int64) * src_layout.block_stride
    src += src_base + first * src_layout.head_stride
    dst = np.asarray(dst_blocks[begin:end], dtype=np.int64) * dst_layout.block_stride
    dst += dst_base + (first - dst_head_offset) * dst_layout.head_stride
    starts = np.flatnonzero(
        np.r_[True, (src[1:] != src[:-1] + nbytes) | (dst[1:] != dst[:-1] + nbytes)]
    )
    lengths = np.diff(np.r_[starts, n]) * nbytes
    return [
        WriteOp(int(s), int(d), int(size))
        for s, d, size in zip(src[starts], dst[starts], lengths, strict=True)
    ]


def _token_runs(
    src_base,
    dst_base,
    src_layout,
    dst_layout,
    src_blocks,
    dst_blocks,
    num_tokens,
    heads,
    dst_head_offset,
    start=0,
) -> list[WriteOp]:
    """Any block sizes: per head, runs of tokens [start, num_tokens) that stay inside one block
    on both sides."""
    ops = []
    for head in heads:
        t = start
        while t < num_tokens:
            s_block, s_off = divmod(t, src_layout.block_size)
            d_block, d_off = divmod(t, dst_layout.block_size)
            run = min(src_layout.block_size - s_off, dst_layout.block_size - d_off, num_tokens - t)
            ops.append(
                WriteOp(
                    src_base
                    + src_blocks[s_block] * src_layout.block_stride
                    + head * src_layout.head_stride
                    + s_off * src_layout.token_stride,
                    dst_base
                    + dst_blocks[d_block] * dst_layout.block_stride
                    + (head - dst_head_offset) * dst_layout.head_stride
                    + d_off * dst_layout.token_stride,
                    run * src_layout.token_stride,
                )
            )
            t += run
    return ops


def _blocks(num_tokens: int, layout: BlockLayout) -> int:
    return -(-num_tokens // layout.block_size)
