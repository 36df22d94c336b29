"""Paged attention on the GPU: a Triton split-K ("flash-decoding") kernel for decode batches.

The same functions as engine.attention, so this module is itself a backend
(`CausalLM(config, attention=engine.triton_attention)`). `write_kv` stores K and V of every new
token with one kernel (the torch index write takes four: slot arithmetic and two scatters, once
per layer per step). `paged_attention` runs Triton only for decode-only batches
(`max_query_len == 1`, row i of q is sequence i's one new token); in prefill and mixed batches
decode rows still use it, and each prefill chunk runs flash attention (SDPA). `attention`, the
model's call, is both; in decode-only batches the split kernel writes the new K/V itself.

The decode path is CUDA-graph capturable: launch grids and buffer sizes depend only on host ints
(q's shape, the cache shape and the block-table width), never on tensor values. The kernels,
in engine.triton_attention_kernels:

- `split_kernel`, grid (sequence, kv head, split): one program attends all query heads of one
  kv head's GQA group (padded to 16 rows for tl.dot) over one split of the context, so each K/V
  tile is read from HBM once. It walks TILE tokens per step, gathering each token's block id from
  the block table (a tile may span several small blocks or part of a large one), with an online
  softmax in fp32. A sequence's tiles are divided over the splits in the kernel, from its
  length in `seq_lens`, so short sequences leave trailing splits empty: such a split stores
  out = 0 and lse = -inf, or with many splits (FEW_TILES) exits at once, storing nothing. With
  one split the kernel writes the final output directly. Called by `attention`, it also gets
  each sequence's new K/V: split 0 attends to them from registers after its tiles of the context
  before them, and stores them in the cache. Then the context's K/V do not depend on the kernel
  before (the qkv projection), and with several splits (small batches: a split has a few tiles)
  each program requests its first tile before it waits for that kernel: into registers, or
  (FEW_TILES) into L2 where that is its only tile.
  Rows that are consecutive tokens of one sequence (a speculative verification's:
  AttentionMetadata.row_in_seq) are attended by the programs of the sequence's first row,
  their query rows stacked in the dot (4 rows of a GQA group of 4 fill its 16), each masked
  at its own token; the other rows' programs exit at once. So each tile of the context is
  read once a step, not once a row (4 times, at depth 3). Called by `attention`, split 0
  also gets the rows' new K/V, attends them as a tile of their own (each row up to its
  token) and stores them, as for one row.
- `combine_kernel`, grid (sequence, query head): merges the partial outputs of the splits that
  have tiles (and split 0) by log-sum-exp.
- `write_kv_kernel`, grid (token, kv head): copies one head of one token's K and V to its slot.

On CUDA each kernel is launched with programmatic dependent launch (engine.triton_pdl), so its
launch overlaps the end of the kernel before it.

An fp8 cache (float8_e4m3fn, scale 1.0: EngineConfig.kv_cache_dtype) holds K and V rounded to
nearest and saturated at +-448, as vLLM's CUDA cache write stores them. The kernels read its bytes
and widen each tile to q's dtype (exact) before the dots; the new token is attended as it was
stored, rounded, so that every step sees the same K/V. Tiles keep the tokens of a bf16 tile: the
widened tile occupies the registers the tuned bf16 one does.
"""

import torch
import triton

from engine import triton_attention_kernels, triton_device, triton_pdl
from engine.attention import AttentionMetadata, attend_batch
from engine.fp8 import FP8_DTYPE

__all__ = ["attention", "choose_num_splits", "paged_attention", "write_kv"]

_LOG2_E = 1.4426950408889634
# K and V tile bytes per loop step (each): enough bytes in flight per program for a memory-bound
# loop, small enough that two pipeline stages of K and V (64 KiB) leave room for two programs
# per SM. Untuned: a starting point, not a measured optimum.
_TILE_BYTES = 16 * 1024
_NUM_STAGES = 2
_NUM_WARPS = 4
# Splits merged per step of the combine loop: every split of a decode step in one step (each step
# is a dependent round trip to memory), up to this many.
_MAX_COMBINE_CHUNK = 64
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Above this many splits (batches of 1 and 2 on an H200: 33 and 17), a context of up to one
# tile a split is short enough to be common: empty splits exit at once and a split's only tile
# is requested into L2. With fewer splits those branches, even untaken, made the step slower
# (bs=4, 9 splits: -0.35% tok/s; bs=8, 5 splits: +0.5-0.9% a graph replay; docs/performance.md).
_FEW_TILES_SPLITS = 9


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's cached context.

    The new tokens' K/V must already be written (`write_kv`). Returns [T, num_heads, head_dim].
    `num_splits` overrides the decode path's split count (tests and tuning); None picks it with
    `choose_num_splits`.
    """
    if meta.max_query_len != 1:  # prefill in the batch: never in a CUDA graph
        return attend_batch(q, k_cache, v_cache, meta, scale, _decode_rows)
    rows = None if meta.row_in_seq is None else (meta.row_in_seq, meta.max_rows_per_seq)
    seq_lens, tables = meta.seq_lens, meta.block_tables
    return _decode(q, k_cache, v_cache, seq_lens, tables, scale, num_splits, rows_of_seq=rows)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`write_kv` of the new tokens' k, v [T, num_kv_heads, head_dim], then `paged_attention` of
    q. Decode batches do both in the split kernel: it stores each sequence's new K/V and
    attends to them from registers, so no kernel of its own writes them; so do rows told
    apart by `meta.row_in_seq` (all of a sequence's rows' K/V in the programs of its first)."""
    rows = None if meta.row_in_seq is None else (meta.row_in_seq, meta.max_rows_per_seq)
    if meta.max_query_len != 1 or (meta.new_kv_first and rows is None):
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
    new_kv = (k, v, meta.slot_mapping)
    seq_lens, tables = meta.seq_lens, meta.block_tables
    return _decode(q, k_cache, v_cache, seq_lens, tables, scale, num_splits, new_kv, rows)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new tokens' k, v [T, num_kv_heads, head_dim] at their slots in the paged cache
    ([num_blocks, num_kv_heads, block_size, head_dim], K and V alike)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    pdl = triton_pdl.enabled(k.device)
    triton_attention_kernels.write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[2],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip


def _decode_rows(q, k_cache, v_cache, seq_lens, block_tables, scale) -> torch.Tensor:
    return _decode(q, k_cache, v_cache, seq_lens, block_tables, scale, None)


def choose_num_splits(batch: int, num_kv_heads: int, max_tiles: int, sm_count: int) -> int:
    """Splits per (sequence, kv head): enough programs to fill ~2 waves of the SMs, but no more
    than `max_tiles`, the tiles (or blocks, if fewer) of the longest possible context: beyond
    that a split could never get work."""
    wanted = -(-2 * sm_count // (batch * num_kv_heads))
    return max(1, min(wanted, max_tiles))


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rows_of_seq: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """new_kv: (k, v [batch, num_kv_heads, head_dim], slots [batch]) of each sequence's last
    token, not yet in the cache: the split kernel stores them and attends to them.
    rows_of_seq: (row_in_seq [batch], at most how many rows a sequence has), for rows that are
    consecutive tokens of one sequence (AttentionMetadata.row_in_seq): one program reads each
    tile of the context for all of a sequence's rows; with new_kv, their K/V (each row's new
    token) come in registers and are stored by it."""
    batch, num_heads, head_dim = q.shape
    row_in_seq, fed = rows_of_seq if rows_of_seq is not None else (seq_lens, 1)
    _, num_kv_heads, block_size, _ = k_cache.shape
    assert seq_lens.shape[0] == batch, "a decode batch has one query row per sequence"
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.dtype == v_cache.dtype in (q.dtype, FP8_DTYPE), (q.dtype, k_cache.dtype)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "head_dim must be contiguous"
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    head_dim_pad = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    tile = _tile_tokens(head_dim_pad, q.element_size())
    if num_splits is None:
        # The longest context any replay of a captured graph may bring: the block table's width.
        max_blocks = block_tables.shape[1]
        max_tiles = min(max_blocks, -(-max_blocks * block_size // tile))
        # Programs of a sequence's rows after its first exit at once: count the sequences.
        sequences = -(-batch // fed)
        sms = triton_device.sm_count(q.device)
        num_splits = choose_num_splits(sequences, num_kv_heads, max_tiles, sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits == 1:
        partial, lse = out, out  # the kernel writes the output itself and no lse
        partial_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        partial = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_strides = partial.stride()[:3]
        lse_strides = lse.stride()[:2]
    if new_kv is not None:
        new_k, new_v, slots = new_kv
        assert new_k.shape == new_v.shape == (batch, num_kv_heads, head_dim)
        assert new_k.stride(-1) == new_v.stride(-1) == 1 and new_k.dtype == q.dtype
        new_strides = (*new_k.stride()[:2], *new_v.stride()[:2])
    else:
        new_k, new_v, slots, new_strides = q, q, seq_lens, (0, 0, 0, 0)  # unread
    triton_attention_kernels.split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        new_k,
        new_v,
        slots,
        *new_strides,
        seq_lens,
        row_in_seq,
        block_tables,
        partial,
        lse,
        scale * _LOG2_E,
        num_splits,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *partial_strides,
        *lse_strides,
        GROUP=group,
        FED=fed,
        ROWS_PAD=max(_MIN_DOT, triton.next_power_of_2(fed * group)),
        NEW_PAD=max(_MIN_DOT, triton.next_power_of_2(fed)),
        ROW_LIMITS=fed > 1 and new_kv is None,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=tile,
        # NOTE: tl.dot defaults to tf32 for fp32 operands, ~3 decimal digits; bf16/fp16 ignore it.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WRITE_LSE=num_splits > 1,
        NEW_KV=new_kv is not None,
        # Where a split has a tile or two (small batches): at bs=64, one split a sequence, it
        # costs more in registers than it gains (docs/performance.md).
        PRELOAD=new_kv is not None and num_splits > 1,
        FEW_TILES=num_splits > _FEW_TILES_SPLITS,
        PDL=triton_pdl.enabled(q.device),
        LINE=128 // k_cache.element_size(),
        LINES_PAD=triton.next_power_of_2(-(-head_dim * k_cache.element_size() // 128)),
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
        launch_pdl=triton_pdl.enabled(q.device),
    )
    if num_splits > 1:
        lens = (seq_lens, row_in_seq, fed)
        _combine(partial, lse, out, lens, head_dim_pad, tile, new_kv is not None)
    return out


def _combine(
    partial: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    lens: tuple[torch.Tensor, torch.Tensor, int],
    head_dim_pad: int,
    tile: int,
    new_kv: bool,
) -> None:
    """lens: (seq_lens, row_in_seq, rows a sequence has at most), as the split kernel had."""
    batch, num_heads, num_splits, head_dim = partial.shape
    seq_lens, row_in_seq, fed = lens
    triton_attention_kernels.combine_kernel[(batch, num_heads)](
        partial,
        lse,
        out,
        seq_lens,
        row_in_seq,
        num_splits,
        *partial.stride()[:3],
        *lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        CHUNK=min(_MAX_COMBINE_CHUNK, triton.next_power_of_2(num_splits)),
        NEW_KV=new_kv,
        FED=fed,
        TILE=tile,
        PDL=triton_pdl.enabled(out.device),
        num_warps=_NUM_WARPS,
        launch_pdl=triton_pdl.enabled(out.device),
    )


def _tile_tokens(head_dim_pad: int, element_size: int) -> int:
    """Tokens per loop step: a power of two in [16, 128] giving ~_TILE_BYTES of K."""
    tokens = max(1, _TILE_BYTES // (head_dim_pad * element_size))
    return min(128, max(_MIN_DOT, 1 << (tokens.bit_length() - 1)))
