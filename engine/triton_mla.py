"""Paged MLA decode on the GPU: a Triton split-K kernel over the latent cache (DeepSeek-V2/V3).

The absorbed form of engine.mla (`attend_absorbed`) for decode batches: row i of the query
[q_c | q_pe] [n, heads, latent_dim] is sequence i's one new token, already in latent space (q_c
= q_nope W_UK, and q_pe, given apart so that no kernel concatenates them); it attends over the
sequence's cached latent rows [c_kv | k_pe] (engine.mla's plane [num_blocks, 1, block_size,
latent_dim]), scoring all latent_dim channels and averaging the first kv_lora_rank (c_kv) as
values. `store_latent` makes and stores the new rows first (and rotates q_pe). With
`decode_attention` (W_UK, `mla_decode`, W_UV: engine.triton_mla_heads), this module is
engine.mla's LatentBackend on CUDA. All three are CUDA-graph capturable: launch grids and
buffer sizes depend only on host ints (shapes), never on tensor values.

The design follows engine.triton_attention's split kernel; what differs comes from MLA's one
shared latent "kv head", 576 channels wide (512 + 64 for DeepSeek), read as both K and V:
- `_split_kernel`, grid (head block, sequence, split): one program attends BLOCK_H = 16 query
  heads (tl.dot's minimum M) over one split of the context, so each latent tile read from HBM
  serves 16 heads, as K (scores = q_c c_kv^T + q_pe k_pe^T, two dots: latent_dim is no power of
  two) and as V (acc [BLOCK_H, kv_lora_rank] fp32 += p c_kv, from the same shared-memory
  buffer). It walks TILE rows a step with an online softmax in fp32 and exp2. TILE divides the
  block size, so a tile lies in one block: one block id, loaded a step ahead, lets the pipeliner
  request tiles num_stages - 1 steps ahead (see the loop). DeepSeek-V2-Lite's 16 heads are one
  head block; V3's 128 are eight, which read the same tiles: the head block is the grid's
  fastest axis, so those eight programs are launched together and all but the first read the
  tiles from L2. (A larger BLOCK_H reads them once: 64, for wgmma, needs 8 warps and 180 KiB of
  shared memory, one program an SM; untried, an option for V3's compute-bound step.)
  A sequence's tiles are divided over the splits in the kernel, from `seq_lens`; a split with no
  tiles (a short sequence's trailing ones) exits at once, storing nothing, except split 0, which
  stores out = 0 and lse = -inf for a zero-length (padding) row. With one split the kernel
  writes the final output itself.
- `_combine_kernel`, grid (sequence, head, channel block): merges the partial outputs of the
  splits with tiles by log-sum-exp. Unlike triton_attention's, it splits the 512 channels over
  programs: a [splits, 512] fp32 chunk per program would be 4× that kernel's registers.
- `store_latent` is engine.triton_latent_store's (the new rows' norm, RoPE and store).

Splits (`choose_num_splits`): about one program per SM, where triton_attention aims at two. A
split's partial output (BLOCK_H × kv_lora_rank fp32: 32 KiB, the bytes of 28 bf16 latent rows)
goes to memory and back through the combine, so splits beyond filling the SMs cost more than
they add. On an H200 (132 SMs), a batch of 1 gets 132 splits: at 8k tokens, two 32-row tiles
each. On CUDA each kernel is launched with programmatic dependent launch (engine.triton_pdl).

Compiled offline for sm_90 (ptxas, Triton 3.6), DeepSeek in bf16 (TILE 32, 3 stages, 4 warps):
125 registers a thread, no spills, 91 KiB of shared memory (two tile buffers and q): two
programs an SM.

An fp8 plane (float8_e4m3fn, scale 1.0: EngineConfig.kv_cache_dtype, 576 bytes a DeepSeek row)
is read as stored and each tile widened to q's dtype (exactly) before the dots, as
engine.triton_attention reads an fp8 K/V cache; tiles keep the rows of a bf16 tile, so that the
widened tile takes the registers the bf16 one does.
"""

import torch
import triton
import triton.language as tl

from engine import triton_device, triton_mla_heads, triton_pdl
from engine.attention import AttentionMetadata
from engine.fp8 import FP8_DTYPE
from engine.mla import absorbed_decode
from engine.triton_attention_kernels import merge_splits, split_tiles
from engine.triton_latent_store import store_latent

__all__ = ["choose_num_splits", "decode_attention", "mla_decode", "store_latent"]

_LOG2_E = 1.4426950408889634
# Latent tile bytes per loop step: 32 DeepSeek rows in bf16 (36 KiB, about the K plus V bytes of
# triton_attention's step). Untuned, as the next two: starting points, not measured optima.
_TILE_BYTES = 40 * 1024
# Tile bytes a program has requested ahead (the pipeline's buffers: two DeepSeek bf16 tiles, four
# of 16 rows), so that with q (18 KiB) two programs fit in an SM's shared memory.
_BYTES_AHEAD = 72 * 1024
_MAX_STAGES = 5
_NUM_WARPS = 4
# Query heads a program attends: tl.dot's minimum M. (32 heads at 4 warps took 251 registers a
# thread, against 125.)
_BLOCK_H = 16
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# The combine's program merges [CHUNK, _COMBINE_DIMS] fp32 partials a step: up to 64 splits (a
# step is a dependent round trip to memory) of 128 channels, triton_attention's chunk size.
_COMBINE_DIMS = 128
_MAX_COMBINE_CHUNK = 64


def mla_decode(
    q_c: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of the query [q_c | q_pe] (q_c [n, heads, kv_lora_rank], q_pe [n, heads,
    rope], rows sequence i's new token, any strides with contiguous channels) over the latent
    rows of each sequence (seq_lens [n] int32, block_tables [n, width] int32), the plane [blocks,
    1, block_size, kv_lora_rank + rope] holding the new tokens' rows already -> [n, heads,
    kv_lora_rank] in q's dtype, a view of a [heads, n, kv_lora_rank] tensor (W_UV's batched GEMM
    reads it as it is). `num_splits` overrides the split count (tests and tuning); None picks it
    with `choose_num_splits`."""
    _check_shapes(q_c, q_pe, cache, seq_lens, block_tables)
    batch, num_heads, kv_lora_rank = q_c.shape
    rope_dim = q_pe.shape[2]
    block_size, cache_dim = cache.shape[2:]
    q_c, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_c, q_pe))
    head_blocks = triton.cdiv(num_heads, _BLOCK_H)
    assert block_size >= _MIN_DOT and block_size & (block_size - 1) == 0, block_size
    assert block_tables.shape[1] >= 1, "block tables need a column"
    row_bytes = cache_dim * q_c.element_size()  # an fp8 plane's rows, widened to q's dtype
    tile = min(block_size, _tile_tokens(row_bytes))  # a tile lies in one block
    if num_splits is None:
        # The longest context any replay of a captured graph may bring: the block table's width.
        max_tiles = triton.cdiv(block_tables.shape[1] * block_size, tile)
        sms = triton_device.sm_count(q_c.device)
        num_splits = choose_num_splits(batch, head_blocks, max_tiles, sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    out = q_c.new_empty(num_heads, batch, kv_lora_rank).transpose(0, 1)
    if num_splits == 1:
        partial, lse = out, out  # the kernel writes the output itself and no lse
        partial_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        partial = torch.empty(
            batch, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q_c.device
        )
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q_c.device)
        partial_strides, lse_strides = partial.stride()[:3], lse.stride()[:2]
    rank_pad = max(_MIN_DOT, triton.next_power_of_2(kv_lora_rank))
    pdl = triton_pdl.enabled(q_c.device)
    _split_kernel[(head_blocks, batch, num_splits)](
        q_c, q_pe, cache, seq_lens, block_tables, partial, lse,
        scale * _LOG2_E, num_splits, num_heads,
        q_c.stride(0), q_c.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(2), block_tables.stride(0),
        *partial_strides, *lse_strides,
        RANK=kv_lora_rank, RANK_PAD=rank_pad,
        ROPE=rope_dim, ROPE_PAD=max(_MIN_DOT, triton.next_power_of_2(rope_dim)),
        BLOCK_H=_BLOCK_H, BLOCK_SIZE=block_size, TILE=tile,
        # NOTE: tl.dot defaults to tf32 for fp32 operands, ~3 decimal digits; bf16/fp16 ignore it.
        PRECISION="ieee" if q_c.dtype == torch.float32 else "tf32",
        WRITE_LSE=num_splits > 1, PDL=pdl,
        num_warps=_NUM_WARPS, num_stages=_num_stages(tile * row_bytes), launch_pdl=pdl,
    )  # fmt: skip
    if num_splits > 1:
        _combine(partial, lse, out, seq_lens, tile)
    return out


def _check_shapes(q_c, q_pe, cache, seq_lens, block_tables) -> None:
    rank, rope = q_c.shape[2], q_pe.shape[2]
    assert cache.shape[1] == 1 and q_pe.shape[:2] == q_c.shape[:2], (cache.shape, q_c.shape)
    if rank < 1 or rope < 1 or rank + rope != cache.shape[3]:
        raise ValueError(
            f"kv_lora_rank + rope must split the latent ({cache.shape[3]}), got {rank} + {rope}"
        )
    assert seq_lens.shape[0] == q_c.shape[0] == block_tables.shape[0], "a query row a sequence"
    assert q_c.dtype == q_pe.dtype and cache.dtype in (q_c.dtype, FP8_DTYPE), (
        q_c.dtype,
        q_pe.dtype,
        cache.dtype,
    )
    assert cache.stride(-1) == 1, "latent rows must be contiguous"


def _combine(
    partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor, tile: int
) -> None:
    batch, num_heads, num_splits, kv_lora_rank = partial.shape
    dims = min(triton.next_power_of_2(kv_lora_rank), _COMBINE_DIMS)
    pdl = triton_pdl.enabled(out.device)
    _combine_kernel[(batch, num_heads, triton.cdiv(kv_lora_rank, dims))](
        partial, lse, out, seq_lens, num_splits,
        *partial.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
        RANK=kv_lora_rank, DIMS=dims, TILE=tile,
        CHUNK=min(_MAX_COMBINE_CHUNK, triton.next_power_of_2(num_splits)),
        PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip


def decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """engine.mla.LatentBackend.decode_attention: W_UK, `mla_decode` and W_UV of a decode-only
    batch (engine.triton_mla_heads for the projections)."""
    assert meta.max_query_len == 1, "one new token per sequence"
    return absorbed_decode(
        triton_mla_heads.absorb_query, _attend, triton_mla_heads.expand_output,
        q_nope, q_pe, cache, meta, kv_b_weight, scale,
    )  # fmt: skip


def _attend(q_c, q_pe, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return mla_decode(q_c, q_pe, cache, meta.seq_lens, meta.block_tables, scale)


def choose_num_splits(batch: int, head_blocks: int, max_tiles: int, sm_count: int) -> int:
    """Splits per (sequence, head block): enough programs for about one per SM, but no more than
    `max_tiles`, the tiles of the longest possible context: beyond that a split could never get
    work. (One per SM, not triton_attention's two: see the module docstring.)"""
    wanted = -(-sm_count // (batch * head_blocks))
    return max(1, min(wanted, max_tiles))


def _tile_tokens(row_bytes: int) -> int:
    """Latent rows per loop step: a power of two in [16, 64] giving at most ~_TILE_BYTES."""
    rows = max(1, _TILE_BYTES // row_bytes)
    return min(64, max(_MIN_DOT, 1 << (rows.bit_length() - 1)))


def _num_stages(tile_bytes: int) -> int:
    """Pipeline stages: loads run num_stages - 1 tiles ahead, _BYTES_AHEAD of them."""
    return min(_MAX_STAGES, 1 + max(1, _BYTES_AHEAD // tile_bytes))


@triton.jit
def _load_tile(
    block_ptr, tile, seq_len, rank_dims, rope_dims, stride_ct,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """c_kv [TILE, RANK_PAD] and k_pe [TILE, ROPE_PAD] of one tile of the context, which lies
    in the block at block_ptr, and which of its rows are in the context."""
    pos = tile * TILE + tl.arange(0, TILE)
    valid = pos < seq_len
    rows = block_ptr + ((pos % BLOCK_SIZE) * stride_ct)[:, None]
    # NOTE: slots past the context may hold NaN bit patterns (a remote sender writes whole
    # blocks), and 0 * NaN is NaN: the loads are masked, not just the scores.
    c_kv = tl.load(
        rows + rank_dims[None, :], mask=valid[:, None] & (rank_dims < RANK)[None, :], other=0.0
    )
    k_pe = tl.load(
        rows + RANK + rope_dims[None, :],
        mask=valid[:, None] & (rope_dims < ROPE)[None, :],
        other=0.0,
    )
    return c_kv, k_pe, valid


@triton.jit
def _attend_tile(
    q_c, q_pe, c_kv, k_pe, valid, m, sum_exp, acc, scale_log2, PRECISION: tl.constexpr
):
    """One online-softmax step over a tile holding at least one valid row. c_kv serves as both
    the keys' first channels and the values."""
    scores = tl.dot(q_c, tl.trans(c_kv), input_precision=PRECISION)
    scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=PRECISION) * scale_log2
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))  # finite: the tile holds a valid row
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    sum_exp = sum_exp * alpha + tl.sum(p, 1)
    # p is rounded to the cache dtype for the tensor-core dot, as in flash attention.
    acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, sum_exp, acc


@triton.jit
def _split_kernel(
    q_c_ptr,  # [B, heads, RANK]
    q_pe_ptr,  # [B, heads, ROPE]
    cache_ptr,  # [blocks, 1, block_size, latent_dim]
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,  # [B, heads, splits, rank] fp32 partials; [B, heads, rank] output with one split
    lse_ptr,  # [B, heads, splits] fp32, log2 domain; unused with one split
    scale_log2,  # softmax scale times log2(e): exp2 replaces exp
    num_splits,
    num_heads,
    stride_qcb,
    stride_qch,
    stride_qpb,
    stride_qph,
    stride_cb,
    stride_ct,
    stride_table,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    RANK: tl.constexpr,  # kv_lora_rank: c_kv's channels, the values
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,  # k_pe's channels, after c_kv's
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, num_tiles, tiles_per_split = split_tiles(seq_len, num_splits, False, 1, TILE)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    if split > 0 and tile_begin >= tile_end:
        # An empty split stores nothing and frees its slot at once: the combine reads only the
        # splits with tiles, counted as here. Split 0 always stores (a zero-length row's zeros).
        return

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    rank_dims = tl.arange(0, RANK_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    rank_mask = head_mask[:, None] & (rank_dims < RANK)[None, :]
    table = block_tables_ptr + seq * stride_table
    # q and the new token's row come from the kernels before (lengths and block tables were
    # written before the step's first kernel).
    triton_pdl.await_previous_kernel(PDL)
    q_c_rows = q_c_ptr + seq * stride_qcb + heads[:, None] * stride_qch
    q_c = tl.load(q_c_rows + rank_dims[None, :], mask=rank_mask, other=0.0)
    rope_mask = head_mask[:, None] & (rope_dims < ROPE)[None, :]
    q_pe_rows = q_pe_ptr + seq * stride_qpb + heads[:, None] * stride_qph
    q_pe = tl.load(q_pe_rows + rope_dims[None, :], mask=rope_mask, other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, log2 domain
    sum_exp = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    # Each tile's block id is loaded a step ahead: then a tile's address depends on no load of
    # its own step, and the pipeliner requests the tile num_stages - 1 steps ahead. (A block id
    # loaded in the tile's own step, or one per row, left the tile unbuffered, read only after
    # the step before was done with the one buffer.) Ids past the context repeat its last.
    last_block = tl.maximum(tl.cdiv(seq_len, BLOCK_SIZE) - 1, 0)
    next_block = tl.load(table + tl.minimum(tile_begin * TILE // BLOCK_SIZE, last_block))
    for t in range(tile_begin, tile_end):
        block_ptr = cache_ptr + next_block.to(tl.int64) * stride_cb
        next_block = tl.load(table + tl.minimum((t + 1) * TILE // BLOCK_SIZE, last_block))
        c_kv, k_pe, valid = _load_tile(
            block_ptr, t, seq_len, rank_dims, rope_dims, stride_ct, RANK, ROPE, BLOCK_SIZE, TILE
        )
        c_kv, k_pe = c_kv.to(q_c.dtype), k_pe.to(q_pe.dtype)  # an fp8 plane's rows widened
        m, sum_exp, acc = _attend_tile(
            q_c, q_pe, c_kv, k_pe, valid, m, sum_exp, acc, scale_log2, PRECISION
        )

    # A zero-length row's split 0 has sum_exp == 0: it stores out = 0, lse = -inf.
    nonempty = sum_exp > 0
    acc = acc / tl.where(nonempty, sum_exp, 1.0)[:, None]
    out = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(out + rank_dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=rank_mask)
    if WRITE_LSE:
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, sum_exp, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _combine_kernel(
    partial_ptr,  # [B, heads, splits, rank] fp32
    lse_ptr,  # [B, heads, splits] fp32, log2 domain
    out_ptr,  # [B, heads, rank]
    seq_lens_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    RANK: tl.constexpr,
    DIMS: tl.constexpr,  # channels a program merges
    TILE: tl.constexpr,
    CHUNK: tl.constexpr,  # splits merged a step
    PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    _, num_tiles, tiles_per_split = split_tiles(
        tl.load(seq_lens_ptr + seq), num_splits, False, 1, TILE
    )
    # The splits with tiles, and split 0 always: the others stored nothing.
    used_splits = tl.maximum(1, tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1)))
    triton_pdl.await_previous_kernel(PDL)
    dim_mask = dims < RANK
    partial = partial_ptr + seq * stride_pb + head * stride_ph
    lses = lse_ptr + seq * stride_lb + head * stride_lh
    out = merge_splits(partial, lses, used_splits, stride_ps, dims, dim_mask, DIMS, CHUNK)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )
