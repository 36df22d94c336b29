"""The Triton kernels of engine.triton_attention (which describes them and launches them)."""

import triton
import triton.language as tl

from engine import triton_ops, triton_pdl

__all__ = ["combine_kernel", "split_kernel", "split_tiles", "write_kv_kernel"]


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
def split_tiles(seq_len, num_splits, NEW_KV: tl.constexpr, FED: tl.constexpr, TILE: tl.constexpr):
    """A sequence's context length in the tiles, its tiles, and the tiles of each split (the
    last splits with tiles may have fewer; those after them none)."""
    # NEW_KV: the last token's K/V come in registers; the tiles hold the tokens before it
    # (with FED, seq_len is the sequence's first row's, and so the tokens before its rows').
    # FED > 1 alone: seq_len is the first of up to FED consecutive rows' (a sequence's rows
    # share their splits): the tiles divided are those of the longest the last row can be.
    context_len = seq_len - 1 if NEW_KV else seq_len + (FED - 1)
    num_tiles = tl.cdiv(context_len, TILE)
    return context_len, num_tiles, tl.cdiv(num_tiles, num_splits)


@triton.jit
def split_kernel(
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
    NEW_PAD: tl.constexpr,  # FED to a power of two >= 16: NEW_KV's tile of a sequence's rows
    ROW_LIMITS: tl.constexpr,  # FED without NEW_KV: the tiles hold the rows' tokens too
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
    context_len, num_tiles, tiles_per_split = split_tiles(seq_len, num_splits, NEW_KV, FED, TILE)
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
    if ROW_LIMITS:
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
        # Split 0 attends to the new token(s) from these registers after its tiles, and stores
        # them in the cache for the steps after.
        dim_mask = dims < HEAD_DIM
        if FED > 1:  # the sequence's rows' tokens, a tile of NEW_PAD, one a row
            news = tl.arange(0, NEW_PAD)
            news_in = (news < FED) & (seq + news < tl.num_programs(0))
            index = tl.load(row_in_seq_ptr + seq + news, mask=news_in, other=-1)
            news_in = news_in & (index == news)
            new_rows = seq + news[:, None]
            new_mask = news_in[:, None] & dim_mask[None, :]
            slot = tl.load(slots_ptr + new_rows, mask=news_in[:, None], other=0).to(tl.int64)
            k_at = new_rows * stride_nkb + kv_head * stride_nkh + dims[None, :]
            v_at = new_rows * stride_nvb + kv_head * stride_nvh + dims[None, :]
            dims_at = dims[None, :]
        else:
            new_mask = dim_mask
            slot = tl.load(slots_ptr + seq).to(tl.int64)
            k_at = seq * stride_nkb + kv_head * stride_nkh + dims
            v_at = seq * stride_nvb + kv_head * stride_nvh + dims
            dims_at = dims
        new_k = triton_ops.to_cache(tl.load(new_k_ptr + k_at, new_mask, 0.0), k_ptr)
        new_v = triton_ops.to_cache(tl.load(new_v_ptr + v_at, new_mask, 0.0), v_ptr)
        block_of_slot = slot // BLOCK_SIZE
        offset_of_slot = slot % BLOCK_SIZE
        write = new_mask & (split == 0)
        tl.store(
            k_head + block_of_slot * stride_kb + offset_of_slot * stride_kt + dims_at, new_k, write
        )
        tl.store(
            v_head + block_of_slot * stride_vb + offset_of_slot * stride_vt + dims_at, new_v, write
        )
    if PRELOAD:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if not first_only:  # the tile in registers; else the loop loads it, from L2
            if tile_begin < tile_end:  # else the split is empty (and valid0 all False)
                m, sum_exp, acc = _attend_tile(
                    q, k0, v0, valid0, m, sum_exp, acc, scale_log2, PRECISION, False
                )
            tile_begin += 1
    if ROW_LIMITS:  # the splits divide the longest context possible: this one may be shorter
        tile_end = tl.minimum(tile_end, tl.cdiv(context_len, TILE))
    for t in range(tile_begin, tile_end):
        k, v, valid = _load_tile(
            k_head, v_head, table, t, context_len, dims,
            stride_kb, stride_kt, stride_vb, stride_vt, HEAD_DIM, BLOCK_SIZE, TILE,
        )  # fmt: skip
        if ROW_LIMITS:  # each row sees the context up to its own token
            valid = (t * TILE + tl.arange(0, TILE))[None, :] < limit[:, None]
        m, sum_exp, acc = _attend_tile(
            q, k, v, valid, m, sum_exp, acc, scale_log2, PRECISION, ROW_LIMITS
        )
    if NEW_KV:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if split == 0:
            if FED > 1:  # the rows' tokens, each row up to its own
                causal = news_in[None, :] & (news[None, :] <= fed[:, None])
                m, sum_exp, acc = _attend_tile(
                    q, new_k, new_v, causal, m, sum_exp, acc, scale_log2, PRECISION, True
                )
            else:  # the new token, one query row at a time (no tile to dot)
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
def combine_kernel(
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
    _, num_tiles, tiles_per_split = split_tiles(seq_len, num_splits, NEW_KV, FED, TILE)
    # The splits with tiles, and split 0 always: the others stored nothing (FEW_TILES) or
    # out = 0 and lse = -inf.
    used_splits = tl.maximum(1, tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1)))
    triton_pdl.await_previous_kernel(PDL)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    partial = partial_ptr + seq * stride_pb + head * stride_ph
    lses = lse_ptr + seq * stride_lb + head * stride_lh
    out = merge_splits(partial, lses, used_splits, stride_ps, dims, dim_mask, HEAD_DIM_PAD, CHUNK)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@triton.jit
def write_kv_kernel(
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


@triton.jit
def merge_splits(partial, lses, used_splits, stride_ps, dims, dim_mask, DIMS: tl.constexpr,
                 CHUNK: tl.constexpr):  # fmt: skip
    """One query row's output over `dims` [DIMS] from its splits' partial outputs (split s's at
    partial + s * stride_ps) and their log2-domain sums of exponentials `lses`: the splits'
    outputs weighted by their shares of the softmax, CHUNK splits a step; 0 where every split
    was empty (a zero-length row)."""
    chunk = tl.arange(0, CHUNK)
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.zeros([], tl.float32)
    acc = tl.zeros([DIMS], tl.float32)
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
    return tl.where(denom > 0, acc / tl.where(denom > 0, denom, 1.0), 0.0)
