"""Paged attention on the GPU: a Triton split-K ("flash-decoding") kernel for decode batches.

The same functions as engine.attention, so this module is itself a backend
(`CausalLM(config, attention=engine.triton_attention)`). `write_kv` stores K and V of every new
token with one kernel (the torch index write takes four: slot arithmetic and two scatters, once
per layer per step). `paged_attention` runs Triton only for decode-only batches
(`max_query_len == 1`, row i of q is sequence i's one new token); in prefill and mixed batches
decode rows still use it, and each prefill chunk runs flash attention (SDPA). `attention`, the
model's call, is both; in decode-only batches the split kernel writes the new K/V itself.

The decode path is CUDA-graph capturable: launch grids and buffer sizes depend only on host ints
(q's shape, the cache shape and the block-table width), never on tensor values.

- `_split_kernel`, grid (sequence, kv head, split): one program attends all query heads of one
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
  Rows that are consecutive tokens of one sequence (a speculative verification's, with their
  K/V written first: AttentionMetadata.row_in_seq) are attended by the programs of the
  sequence's first row, their query rows stacked in the dot (4 rows of a GQA group of 4 fill
  its 16), each masked at its own token; the other rows' programs exit at once. So each tile
  of the context is read once a step, not once a row (4 times, at depth 3).
- `_combine_kernel`, grid (sequence, query head): merges the partial outputs of the splits that
  have tiles (and split 0) by log-sum-exp.
- `_write_kv_kernel`, grid (token, kv head): copies one head of one token's K and V to its slot.

On CUDA each kernel is launched with programmatic dependent launch (engine.triton_pdl), so its
launch overlaps the end of the kernel before it.

An fp8 cache (float8_e4m3fn, scale 1.0: EngineConfig.kv_cache_dtype) holds K and V rounded to
nearest and saturated at +-448, as vLLM's CUDA cache write stores them. The kernels read its bytes
and widen each tile to q's dtype (exact) before the dots; the new token is attended as it was
stored, rounded, so that every step sees the same K/V. Tiles keep the tokens of a bf16 tile: the
widened tile occupies the registers the tuned bf16 one does.
"""

import functools

import torch
import triton
import triton.language as tl

from engine import triton_ops, triton_pdl
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
    attends to them from registers, so no kernel of its own writes them."""
    if meta.max_query_len != 1 or meta.new_kv_first:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
    new_kv = (k, v, meta.slot_mapping)
    seq_lens, tables = meta.seq_lens, meta.block_tables
    return _decode(q, k_cache, v_cache, seq_lens, tables, scale, num_splits, new_kv)


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
    _write_kv_kernel[(num_tokens, num_kv_heads)](
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
    consecutive tokens of one sequence, their K/V in the cache (AttentionMetadata.row_in_seq):
    one program reads each tile of the context for all of a sequence's rows."""
    batch, num_heads, head_dim = q.shape
    row_in_seq, fed = rows_of_seq if rows_of_seq is not None else (seq_lens, 1)
    assert fed == 1 or new_kv is None, "grouped rows have their K/V in the cache"
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
        num_splits = choose_num_splits(sequences, num_kv_heads, max_tiles, _sm_count(q.device))
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
    _split_kernel[(batch, num_kv_heads, num_splits)](
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
    _combine_kernel[(batch, num_heads)](
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


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one at a time
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count_of(index)


@triton.jit
def _tile_slots(table, tile, context_len, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """Block id and offset in it of each token of one tile of the context, and which tokens are
    in the context. Block ids come from the block table: a tile may span several small blocks
    or part of a large one."""
    pos = tile * TILE + tl.arange(0, TILE)
    valid = pos < context_len
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block, pos % BLOCK_SIZE, valid


@triton.jit
def _load_tile(
    k_head, v_head, table, tile, context_len, dims,
    stride_kb, stride_kt, stride_vb, stride_vt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """K, V [TILE, HEAD_DIM_PAD] of one tile of the context, and which of its tokens are in it."""
    block, offset, valid = _tile_slots(table, tile, context_len, BLOCK_SIZE, TILE)
    # NOTE: slots past the context may hold NaN bit patterns (a remote sender writes whole
    # blocks; the new token's may not be written yet), and 0 * NaN is NaN: both K and V loads
    # must be masked, not just scores.
    kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(
        k_head + (block * stride_kb + offset * stride_kt)[:, None] + dims[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_head + (block * stride_vb + offset * stride_vt)[:, None] + dims[None, :],
        mask=kv_mask,
        other=0.0,
    )
    return k, v, valid


@triton.jit
def _prefetch_tile(
    k_head, v_head, table, tile, context_len,
    stride_kb, stride_kt, stride_vb, stride_vt,
    LINE: tl.constexpr, LINES_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Asks L2 for the K and V lines (LINE elements each) of one tile of the context, one
    `prefetch.global.L2` a line, so that its loads after the wait hit L2 without holding
    registers before it."""
    block, offset, valid = _tile_slots(table, tile, context_len, BLOCK_SIZE, TILE)
    lines = tl.arange(0, LINES_PAD) * LINE
    wanted = (valid[:, None] & (lines < HEAD_DIM)[None, :]).to(tl.int32)
    k_lines = k_head + (block * stride_kb + offset * stride_kt)[:, None] + lines[None, :]
    v_lines = v_head + (block * stride_vb + offset * stride_vt)[:, None] + lines[None, :]
    _prefetch_l2(k_lines, wanted)
    _prefetch_l2(v_lines, wanted)


@triton.jit
def _prefetch_l2(ptrs, wanted):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, wanted],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _attend_tile(
    q, k, v, valid, m, sum_exp, acc, scale_log2, PRECISION: tl.constexpr, ROWS_VALID: tl.constexpr
):
    """One online-softmax step over a tile holding at least one valid token. valid: [TILE],
    or with ROWS_VALID [rows, TILE], where a row may have none in the tile."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's tile widened (its scale is 1.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    scores = tl.where(valid if ROWS_VALID else valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))  # finite where the row has had a valid token
    shift = m_new
    if ROWS_VALID:  # a row with none yet: m_new is -inf, and exp2(-inf - -inf) would be NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - shift)
    p = tl.exp2(scores - shift[:, None])
    sum_exp = sum_exp * alpha + tl.sum(p, 1)
    # p is rounded to the compute dtype for the tensor-core dot, as in flash attention.
    p = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, sum_exp, acc


@triton.jit
def _split_tiles(seq_len, num_splits, NEW_KV: tl.constexpr, FED: tl.constexpr, TILE: tl.constexpr):
    """A sequence's context length in the tiles, its tiles, and the tiles of each split (the
    last splits with tiles may have fewer; those after them none)."""
    # NEW_KV: the last token's K/V come in registers; the tiles hold the tokens before it.
    # FED > 1: seq_len is the first of up to FED consecutive rows' (a sequence's rows share
    # their splits): the tiles divided are those of the longest the last row can be.
    context_len = seq_len - 1 if NEW_KV else seq_len + (FED - 1)
    num_tiles = tl.cdiv(context_len, TILE)
    return context_len, num_tiles, tl.cdiv(num_tiles, num_splits)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    new_k_ptr,  # [B, kv heads, dim]: NEW_KV's, the last token's K and V, not yet in the cache
    new_v_ptr,
    slots_ptr,  # [B]: NEW_KV's, their slots
    stride_nkb,
    stride_nkh,
    stride_nvb,
    stride_nvh,
    seq_lens_ptr,
    row_in_seq_ptr,  # [B]: FED's, each row's index among its sequence's rows
    block_tables_ptr,
    out_ptr,  # [B, heads, splits, dim] fp32 partials; [B, heads, dim] output with one split
    lse_ptr,  # [B, heads, splits] fp32, log2 domain; unused with one split
    scale_log2,  # softmax scale times log2(e): exp2 replaces exp
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_table,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    FED: tl.constexpr,  # > 1: rows are up to FED consecutive tokens of a sequence (row_in_seq)
    ROWS_PAD: tl.constexpr,  # FED * GROUP query rows of the dot, to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    NEW_KV: tl.constexpr,
    PRELOAD: tl.constexpr,  # the first tile is requested before the wait (NEW_KV only)
    FEW_TILES: tl.constexpr,  # so many splits that short contexts leave splits empty
    PDL: tl.constexpr,
    LINE: tl.constexpr,  # elements of a 128-byte line
    LINES_PAD: tl.constexpr,  # lines of a head's row of K or V, to a power of two
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if FED > 1:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # A sequence's first row attends for all its rows: those after it have nothing to do.
        if tl.load(row_in_seq_ptr + seq) > 0:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len, num_tiles, tiles_per_split = _split_tiles(seq_len, num_splits, NEW_KV, FED, TILE)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    # Query row r of the dot: head r % GROUP of the kv head's group, for the sequence's row
    # `fed` = r // GROUP (0 but with FED), whose context ends at `limit`.
    rows = tl.arange(0, ROWS_PAD)
    fed = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    member = fed == 0
    limit = seq_len
    if FED > 1:
        later = (fed < FED) & (seq + fed < tl.num_programs(0))
        index = tl.load(row_in_seq_ptr + seq + fed, mask=later, other=-1)
        member = later & (index == fed)  # a row whose index is fed is this sequence's
        limit = seq_len + fed
        context_len = tl.max(tl.where(member, limit, 0), 0)  # the last row's context
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_dim_mask = member[:, None] & (dims < HEAD_DIM)[None, :]
    if FEW_TILES:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if split > 0 and tile_begin >= tile_end:
            # An empty split (a short sequence's trailing ones) stores nothing and frees its
            # slot at once: the combine reads only the splits with tiles, counted as here.
            # Split 0 always stores, for the new token or a zero-length row's zeros.
            return
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    table = block_tables_ptr + seq * stride_table
    if PRELOAD:
        # Before the wait: the step's inputs (lengths, block tables) and the context's K/V were
        # all written before this step's first kernel; only q and the new token come from the
        # kernel before. So the split's first tile streams while that kernel ends: into
        # registers, or (FEW_TILES) into L2 where it is the split's only tile. Held in
        # registers, a load keeps the program from reaching the wait until it lands (its
        # operands are laid out for the dot first), which costs more than it saves where the
        # split has nothing else to load; the next tiles' loads hide it where it has.
        first_only = False
        preload_len = context_len
        if FEW_TILES:
            first_only = tiles_per_split == 1
            preload_len = tl.where(first_only, 0, context_len)  # 0: loads nothing
            if first_only and PDL:  # (Triton's interpreter has no inline assembly, nor PDL)
                _prefetch_tile(
                    k_head, v_head, table, tile_begin, context_len,
                    stride_kb, stride_kt, stride_vb, stride_vt,
                    LINE, LINES_PAD, HEAD_DIM, BLOCK_SIZE, TILE,
                )  # fmt: skip
        k0, v0, valid0 = _load_tile(
            k_head, v_head, table, tile_begin, preload_len, dims,
            stride_kb, stride_kt, stride_vb, stride_vt, HEAD_DIM, BLOCK_SIZE, TILE,
        )  # fmt: skip
    triton_pdl.await_previous_kernel(PDL)
    q_rows = (seq + fed) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_dim_mask, other=0.0)

    m = tl.full([ROWS_PAD], float("-inf"), tl.float32)  # running max, log2 domain
    sum_exp = tl.zeros([ROWS_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], tl.float32)
    if NEW_KV:
        # Split 0 attends to the new token from these registers after its tiles, and stores it
        # in the cache for the steps after.
        dim_mask = dims < HEAD_DIM
        new_k = tl.load(new_k_ptr + seq * stride_nkb + kv_head * stride_nkh + dims, dim_mask, 0.0)
        new_v = tl.load(new_v_ptr + seq * stride_nvb + kv_head * stride_nvh + dims, dim_mask, 0.0)
        new_k, new_v = triton_ops.to_cache(new_k, k_ptr), triton_ops.to_cache(new_v, v_ptr)
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        block_of_slot = slot // BLOCK_SIZE
        offset_of_slot = slot % BLOCK_SIZE
        write = dim_mask & (split == 0)
        tl.store(
            k_head + block_of_slot * stride_kb + offset_of_slot * stride_kt + dims, new_k, write
        )
        tl.store(
            v_head + block_of_slot * stride_vb + offset_of_slot * stride_vt + dims, new_v, write
        )
    if PRELOAD:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if not first_only:  # the tile in registers; else the loop loads it, from L2
            if tile_begin < tile_end:  # else the split is empty (and valid0 all False)
                m, sum_exp, acc = _attend_tile(
                    q, k0, v0, valid0, m, sum_exp, acc, scale_log2, PRECISION, False
                )
            tile_begin += 1
    if FED > 1:  # the splits divide the longest context possible: this one may be shorter
        tile_end = tl.minimum(tile_end, tl.cdiv(context_len, TILE))
    for t in range(tile_begin, tile_end):
        k, v, valid = _load_tile(
            k_head, v_head, table, t, context_len, dims,
            stride_kb, stride_kt, stride_vb, stride_vt, HEAD_DIM, BLOCK_SIZE, TILE,
        )  # fmt: skip
        if FED > 1:  # each row sees the context up to its own token
            valid = (t * TILE + tl.arange(0, TILE))[None, :] < limit[:, None]
        m, sum_exp, acc = _attend_tile(
            q, k, v, valid, m, sum_exp, acc, scale_log2, PRECISION, FED > 1
        )
    if NEW_KV:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if split == 0:  # the new token, one query row at a time (no tile to dot)
            score = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * scale_log2
            m_new = tl.maximum(m, score)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(score - m_new)
            sum_exp = sum_exp * alpha + p
            p = p.to(q.dtype).to(tl.float32)  # rounded as the dot's p is
            acc = acc * alpha[:, None] + p[:, None] * new_v.to(tl.float32)[None, :]
            m = m_new

    # An empty split (or a zero-length sequence) has sum_exp == 0: it stores out = 0, lse = -inf.
    nonempty = sum_exp > 0
    acc = acc / tl.where(nonempty, sum_exp, 1.0)[:, None]
    out_rows = (seq + fed) * stride_ob + heads * stride_oh + split * stride_os
    tl.store(
        out_ptr + out_rows[:, None] + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_dim_mask,
    )
    if WRITE_LSE:
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, sum_exp, 1.0)), float("-inf"))
        lse_rows = (seq + fed) * stride_lb + heads * stride_lh + split
        tl.store(lse_ptr + lse_rows, lse, mask=member)


@triton.jit
def _combine_kernel(
    partial_ptr,  # [B, heads, splits, dim] fp32
    lse_ptr,  # [B, heads, splits] fp32, log2 domain
    out_ptr,  # [B, heads, dim]
    seq_lens_ptr,
    row_in_seq_ptr,  # FED's
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    NEW_KV: tl.constexpr,  # as the split kernel's
    FED: tl.constexpr,  # as the split kernel's
    TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if FED > 1:  # the splits of the sequence's first row, which attended for this one
        seq_len -= tl.load(row_in_seq_ptr + seq)
    _, num_tiles, tiles_per_split = _split_tiles(seq_len, num_splits, NEW_KV, FED, TILE)
    # The splits with tiles, and split 0 always: the others stored nothing (FEW_TILES) or
    # out = 0 and lse = -inf.
    used_splits = tl.maximum(1, tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1)))
    triton_pdl.await_previous_kernel(PDL)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    chunk = tl.arange(0, CHUNK)
    partial = partial_ptr + seq * stride_pb + head * stride_ph
    lses = lse_ptr + seq * stride_lb + head * stride_lh
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for first in range(0, used_splits, CHUNK):
        splits = first + chunk
        in_range = splits < used_splits
        lse = tl.load(lses + splits, mask=in_range, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        # Until a non-empty split is seen m_new is -inf; shifting by 0 keeps exp2 free of NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        weight = tl.exp2(lse - shift)  # 0 for a zero-length row's split 0, whose output is 0
        part = tl.load(
            partial + splits[:, None] * stride_ps + dims[None, :],
            mask=in_range[:, None] & dim_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha + tl.sum(weight[:, None] * part, 0)
        denom = denom * alpha + tl.sum(weight, 0)
        m = m_new
    out = tl.where(denom > 0, acc / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, kv heads, dim]
    v_ptr,
    k_cache_ptr,  # [blocks, kv heads, block_size, dim]
    v_cache_ptr,
    slot_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    block_size,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    triton_pdl.await_previous_kernel(PDL)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = dims < HEAD_DIM
    dst = (slot // block_size) * stride_cb + head * stride_ch + (slot % block_size) * stride_ct
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst + dims, triton_ops.to_cache(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + dst + dims, triton_ops.to_cache(v, v_cache_ptr), mask=mask)
