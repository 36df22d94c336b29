"""The model's elementwise chains as Triton kernels, one kernel per op (engine.model.ModelOps).

Unfused, a decode step of an 8B model runs ~25 tiny elementwise kernels per layer (RMSNorm
alone is six), ~800 in all at ~2.5 us each: more than half the time the weights take to
stream. Here each op is one kernel, launched with programmatic dependent launch like every
other kernel of the decode step (engine.triton_pdl), so its launch overlaps the kernel before
it.

Rounding follows the eager ops (engine.model) step by step: RMSNorm normalizes in fp32, rounds
to the activation dtype, then multiplies by the weight and rounds again; the residual sum is
rounded before it is normalized; SwiGLU rounds silu(gate) before multiplying. RoPE computes each
rotated element in fp32 and rounds once.

- `_rms_norm_kernel`, grid (row,): one row; with a residual it also stores x + residual.
- `_silu_and_mul_kernel`, grid (row, column block).
- `_rope_kernel`, grid (token,): every query and key head of one token.

`greedy_tokens` (argmax over each row of the logits, for greedy decode inside the CUDA graph) is
two kernels: per-chunk maxima over many programs, then one program per row (torch's argmax
took 27 us for one 128k-entry row on an H200).
"""

import torch
import triton
import triton.language as tl

from engine import triton_pdl

__all__ = ["add_rms_norm", "greedy_tokens", "rms_norm", "rms_normalized", "rope", "silu_and_mul"]

_SILU_BLOCK = 1024
_ARGMAX_CHUNK = 4096


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = _empty_rows(rows)
    _launch_rms_norm(rows, None, weight, eps, out, None)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    rows = x.reshape(-1, x.shape[-1])
    res_rows = residual.reshape(-1, residual.shape[-1])
    out, summed = _empty_rows(rows), _empty_rows(rows)
    _launch_rms_norm(rows, res_rows, weight, eps, out, summed)
    return out.view(x.shape), summed.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    if out.numel():
        pdl = triton_pdl.enabled(rows.device)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, _SILU_BLOCK))](
            rows, out, width, rows.stride(0), out.stride(0),
            BLOCK=_SILU_BLOCK, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out.view(*gate_up.shape[:-1], width)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, dim], k [T, kv heads, dim] rotated by cos, sin [T, dim / 2] as
    engine.model.rope: half-split pairing, or interleaved pairs (2i, 2i+1) stored de-interleaved;
    q and k may be strided views (of the qkv output)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty_like(k)
    if tokens:
        pdl = triton_pdl.enabled(q.device)
        _rope_kernel[(tokens,)](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
            INTERLEAVED=interleaved, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return q_out, k_out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] -> [n] int64: each row's first largest entry, as torch.argmax."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    chunks = triton.cdiv(vocab, _ARGMAX_CHUNK)
    chunk_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        pdl = triton_pdl.enabled(logits.device)
        _chunk_argmax_kernel[(rows, chunks)](
            logits, chunk_max, chunk_arg, vocab, logits.stride(0), chunks,
            CHUNK=_ARGMAX_CHUNK, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
        _row_argmax_kernel[(rows,)](
            chunk_max, chunk_arg, tokens, chunks,
            CHUNKS_PAD=triton.next_power_of_2(chunks), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return tokens


def _empty_rows(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)  # contiguous


def _launch_rms_norm(x, residual, weight, eps, out, summed) -> None:
    num_rows, width = x.shape
    if not num_rows:
        return
    assert x.stride(1) == 1 and weight.is_contiguous()
    pdl = triton_pdl.enabled(x.device)
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        x, residual if has_residual else x, weight, out, summed if has_residual else out,
        width, eps, x.stride(0), residual.stride(0) if has_residual else 0,
        BLOCK=triton.next_power_of_2(width), HAS_RESIDUAL=has_residual,
        PDL=pdl, launch_pdl=pdl, num_warps=8 if width >= 4096 else 4,
    )  # fmt: skip


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, width], rows stride_x apart
    res_ptr,  # [rows, width], rows stride_res apart; unread without HAS_RESIDUAL
    w_ptr,  # [width]
    out_ptr,  # [rows, width] contiguous
    sum_ptr,  # [rows, width] contiguous: x + residual; unwritten without HAS_RESIDUAL
    width,
    eps,
    stride_x,
    stride_res,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    triton_pdl.await_previous_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # a rounded dtype add
        tl.store(sum_ptr + row * width + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / width + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = rms_normalized(x, inv_rms, w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, out, mask=mask)


@triton.jit
def rms_normalized(x, inv_rms, weight):
    """RMSNorm's arithmetic, for every kernel that normalizes: x (its dtype) times inv_rms in
    fp32, rounded to x's dtype, times weight in fp32 (rounded by the caller to its output's
    dtype). inv_rms and weight broadcast against x."""
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
    return weight.to(tl.float32) * normed


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [rows, 2 * width], rows stride_in apart
    out_ptr,  # [rows, width], rows stride_out apart
    width,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    triton_pdl.await_previous_kernel(PDL)
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    out = (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _rotate(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    cos,
    sin,
    heads,
    half,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Rotates `heads` heads of one token: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin],
    x1 and x2 being the halves, or (INTERLEAVED) the even and the odd channels."""
    rows = tl.arange(0, HEADS_PAD)
    mask = (rows < heads)[:, None] & (half < HALF)[None, :]
    row_ptrs = x_ptr + rows[:, None] * stride_x
    if INTERLEAVED:
        x1 = tl.load(row_ptrs + 2 * half[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row_ptrs + 2 * half[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(row_ptrs + half[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row_ptrs + half[None, :] + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + rows[:, None] * stride_out + half[None, :]
    # Rounded to x's dtype, as a separate rope returns it, then stored in out's (an fp8 KV
    # cache's: `to_cache`).
    src = x_ptr.dtype.element_ty
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(src)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(src)
    tl.store(dst, to_cache(out1, out_ptr), mask=mask)
    tl.store(dst + HALF, to_cache(out2, out_ptr), mask=mask)


@triton.jit
def to_cache(x, cache_ptr):
    """x in the cache's dtype: fp8 rounded to nearest and saturated at +-448 (e4m3's largest
    finite value), as vLLM's CUDA cache write stores it."""
    dtype = cache_ptr.dtype.element_ty
    if dtype.is_fp8():
        return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(dtype)
    return x.to(dtype)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,  # [T, HALF]
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, HALF_PAD)
    triton_pdl.await_previous_kernel(PDL)
    cos = tl.load(cos_ptr + token * HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
    _rotate(
        q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh,
        cos, sin, NUM_HEADS, half, HALF, HEADS_PAD, INTERLEAVED,
    )  # fmt: skip
    _rotate(
        k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh,
        cos, sin, NUM_KV_HEADS, half, HALF, KV_HEADS_PAD, INTERLEAVED,
    )  # fmt: skip


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,  # [rows, vocab], rows stride_row apart
    max_ptr,  # [rows, chunks] float32
    arg_ptr,  # [rows, chunks] int64
    vocab,
    stride_row,
    chunks,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    triton_pdl.await_previous_kernel(PDL)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    best, where = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * chunks + chunk, best)
    tl.store(arg_ptr + row * chunks + chunk, (chunk * CHUNK + where).to(tl.int64))


@triton.jit
def _row_argmax_kernel(
    max_ptr,  # [rows, chunks] float32
    arg_ptr,  # [rows, chunks] int64
    out_ptr,  # [rows] int64
    chunks,
    CHUNKS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, CHUNKS_PAD)
    triton_pdl.await_previous_kernel(PDL)
    best = tl.load(max_ptr + row * chunks + idx, mask=idx < chunks, other=float("-inf"))
    # Left on ties: chunks are in vocabulary order, so the first chunk holding the row's
    # maximum holds its first occurrence.
    _, chunk = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(arg_ptr + row * chunks + chunk))
