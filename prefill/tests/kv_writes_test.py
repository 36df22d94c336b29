"""The send path's write lists, applied with memmove between two real paged caches, must land
every token of every head where the destination expects it."""

import ctypes
import itertools

import pytest
import torch

from prefill.kv_writes import (
    BlockLayout,
    LayerKV,
    coalesce,
    gather_blocks,
    layer_ops,
    valid_bytes,
)
from transport.base import WriteOp

HEADS, DIM = 4, 8


def _cache(num_blocks: int, block_size: int, fill: float | None = None) -> torch.Tensor:
    shape = (2, num_blocks, HEADS, block_size, DIM)  # (K|V, block, head, token, dim): HND
    return torch.full(shape, fill) if fill is not None else torch.randn(shape)


def _layout(cache: torch.Tensor) -> BlockLayout:
    e = cache.element_size()
    return BlockLayout(
        cache.shape[3], cache.stride(1) * e, cache.stride(2) * e, cache.stride(3) * e
    )


def _kv(cache: torch.Tensor) -> LayerKV:
    return LayerKV(cache[0].data_ptr(), cache[1].data_ptr())


def _tokens(cache, blocks, block_size, n, heads):
    """[K|V, n, heads, dim] gathered token by token."""
    rows = [cache[:, blocks[t // block_size], heads, t % block_size] for t in range(n)]
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize(
    ("src_bs", "dst_bs", "heads", "offset"),
    [
        (16, 16, range(0, 4), 0),  # same layout: whole blocks, coalesced
        (16, 8, range(0, 4), 0),  # different block sizes
        (8, 32, range(0, 4), 0),
        (16, 16, range(2, 4), 0),  # one TP rank's heads into a full-head destination
        (16, 16, range(2, 4), 2),  # ... into a destination holding only those heads' slots
    ],
)
def test_writes_land_every_token_where_the_destination_reads_it(src_bs, dst_bs, heads, offset):
    n = 45
    src = _cache(8, src_bs)
    dst = _cache(16, dst_bs, fill=0.0)
    src_blocks = [5, 2, 7, 0, 3, 1, 6, 4][: -(-n // src_bs)]
    dst_blocks = [9, 10, 11, 3, 4, 0, 1, 2, 13, 14][: -(-n // dst_bs)]
    ops = layer_ops(
        _kv(src), _kv(dst), _layout(src), _layout(dst), src_blocks, dst_blocks, n, heads, offset
    )
    for op in ops:
        ctypes.memmove(op.dst, op.src, op.nbytes)
    want = _tokens(src, src_blocks, src_bs, n, list(heads))
    got = _tokens(dst, dst_blocks, dst_bs, n, [h - offset for h in heads])
    assert torch.equal(got, want)


@pytest.mark.parametrize(("src_bs", "dst_bs"), [(16, 16), (16, 8), (8, 32)])
def test_a_prompt_written_in_pieces_lands_each_piece_alone(src_bs, dst_bs):
    """Chunk by chunk, each piece starting where the whole blocks of the pieces before it end:
    a piece lands exactly its own tokens (the last one's tail block whole), nothing else."""
    n, heads, unit = 45, range(0, 4), max(src_bs, dst_bs)
    src = _cache(8, src_bs)
    src_blocks = [5, 2, 7, 0, 3, 1, 6, 4][: -(-n // src_bs)]
    dst_blocks = [9, 10, 11, 3, 4, 0, 1, 2, 13, 14][: -(-n // dst_bs)]
    want = _tokens(src, src_blocks, src_bs, n, list(heads))
    cuts = [0, unit, 2 * unit, n] if 2 * unit < n else [0, unit, n]
    for start, end in itertools.pairwise(cuts):
        dst = _cache(16, dst_bs, fill=0.0)
        sides = (_kv(src), _kv(dst), _layout(src), _layout(dst), src_blocks, dst_blocks)
        for op in layer_ops(*sides, end, heads, start=start):
            ctypes.memmove(op.dst, op.src, op.nbytes)
        got = _tokens(dst, dst_blocks, dst_bs, n, list(heads))
        assert torch.equal(got[:, start:end], want[:, start:end]), (start, end)
        assert torch.all(got[:, :start] == 0) and torch.all(got[:, end:] == 0), (start, end)


def test_same_layout_adjacent_blocks_coalesce_to_one_run_per_k_and_v():
    src, dst = _cache(8, 16), _cache(8, 16, fill=0.0)
    ops = layer_ops(_kv(src), _kv(dst), _layout(src), _layout(dst), [0, 1, 2], [4, 5, 6], 40,
                    range(HEADS))  # fmt: skip
    assert len(ops) == 2 and ops[0].nbytes == 3 * HEADS * 16 * DIM * 4


def test_a_latent_plane_is_written_as_one_head_and_nothing_else():
    """An "mla-latent" layer: one plane (`v` None) of one head whose head_dim is the latent
    width; the writes stay inside that plane's blocks."""
    n, latent = 21, 40
    src = torch.randn(1, 4, 1, 16, latent)  # (plane, block, head, token, dim)
    dst = torch.zeros(2, 6, 1, 8, latent)  # the latent plane, then memory that is not it
    src_layout, dst_layout = _layout(src), _layout(dst)
    ops = layer_ops(
        LayerKV(src[0].data_ptr()), LayerKV(dst[0].data_ptr()), src_layout, dst_layout,
        [3, 1], [5, 0, 2], n, range(1),
    )  # fmt: skip
    for op in ops:
        ctypes.memmove(op.dst, op.src, op.nbytes)
    assert torch.equal(_tokens(dst, [5, 0, 2], 8, n, [0])[0], _tokens(src, [3, 1], 16, n, [0])[0])
    assert not dst[1].any()
    assert valid_bytes(n, 1, latent * 4, num_layers=3, planes=1) == 3 * n * latent * 4


def test_coalesce_merges_only_runs_that_continue_on_both_sides():
    ops = [WriteOp(0, 100, 10), WriteOp(10, 110, 5), WriteOp(15, 200, 5), WriteOp(20, 205, 1)]
    assert coalesce(ops) == [WriteOp(0, 100, 15), WriteOp(15, 200, 6)]


def test_valid_bytes_counts_prompt_tokens_only():
    assert (
        valid_bytes(num_tokens=45, num_heads=4, token_stride=32, num_layers=30)
        == 2 * 30 * 45 * 4 * 32
    )


@pytest.mark.parametrize(("token_tile", "dim_tile"), [(1, 1), (4, 2), (2, 4)])
def test_gather_blocks_from_strided_and_tiled_views(token_tile, dim_tile):
    """Tokens [5, 23) of a sequence on scattered blocks, gathered into destination blocks of 8
    tokens, from a view whose memory is not rows: a transposed one, or one whose tokens and
    dimensions are split in two and interleaved (as AMX tiles pack them)."""
    block_size, num_blocks = 16, 4
    rows = torch.randn(num_blocks, HEADS, block_size, DIM)  # what each token's row holds
    if token_tile == dim_tile == 1:
        memory = rows.transpose(2, 3).contiguous()  # [block, head, dim, token]
        view = memory.transpose(2, 3)
    else:
        tiled = rows.view(
            num_blocks, HEADS, block_size // token_tile, token_tile, DIM // dim_tile, dim_tile
        )
        # Memory order [block, head, token hi, dim hi, token lo, dim lo]: neither whole.
        memory = tiled.permute(0, 1, 2, 4, 3, 5).contiguous()
        view = memory.permute(0, 1, 2, 4, 3, 5)
    src_blocks = [3, 0, 2]
    out = torch.full((3, HEADS, 8, DIM), float("nan"))
    gather_blocks(view, src_blocks, 5, 23, out)
    want = torch.cat([rows[b] for b in src_blocks], dim=1)[:, 5:23]  # [heads, 18, dim]
    got = out.permute(1, 0, 2, 3).reshape(HEADS, 24, DIM)
    assert torch.equal(got[:, :18], want)
    assert got[:, 18:].isnan().all()  # rows past the end are left as they were
