"""Matrix products of a few rows (2 to 64) on the GPU: a speculative verification's k + 1
positions, a small batch's decode step. Each weight tile is read once for all the rows.

Such a product is as memory-bound as the one-row GEMV (engine.triton_linear): its bytes are the
weight's. Through cuBLAS a verification's layer is also four more kernels than a one-token
step's (the norms, RoPE, SwiGLU and the residual adds, which the GEMV does in its epilogues),
none overlapping its neighbours' launch; figures in docs/performance.md.

`_rows_kernel`, grid (N / BLOCK_N,): one program owns BLOCK_N whole rows of W and walks K in
BLOCK_K steps; at each, tl.dot multiplies its [BLOCK_N, BLOCK_K] weight tile by the rows' tile,
padded to a power of two of at least 16 (the dot's smallest width; zeros, never read), into an
fp32 [BLOCK_N, M_PAD] accumulator. The weight's first tile is requested before the kernel waits
for the one before it (programmatic dependent launch, as the GEMV), the rest pipelined by
Triton (num_stages). The product is rounded once, as F.linear's is."""

import torch
import triton
import triton.language as tl

from engine import triton_device, triton_pdl

__all__ = [
    "MAX_ROWS",
    "ROPE",
    "SILU",
    "STORE",
    "applies",
    "launch",
    "pairs",
    "program_rows",
    "weight_tile",
]

MAX_ROWS = 64
"""The most rows a product may have here; past it, cuBLAS's tiles read the weight once too."""

# What the kernel does with its rounded outputs (the EPILOGUE constexpr), as the GEMV's.
STORE, SILU, ROPE = 0, 1, 2

# (rows of W per program, K step, warps, pipeline stages), one set for every shape: of
# `engine.gemv_bench --rows 4 --sweep` on an H100 (docs/performance.md), the best for qkv and
# within 1-4 points of each other shape's best, every shape above cuBLAS streamed alone.
# 4 stages of a 64 x 256 tile, the best for o_proj and lm_head, take more shared memory than
# an SM has with the norm's epilogue (engine/tests/sm90_compile_test.py).
_SETTINGS = (64, 256, 4, 3)
# Each stage's tiles stay within this, so that 3 stages (Triton keeps one buffer more) fit an
# SM's 227 KiB with the norm's epilogue at 64 rows, where a 64 x 256 stage of W and x is 64 KiB.
_STAGE_BYTES = 48 * 1024


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes x @ weight.T: 2 to MAX_ROWS rows of a matrix's 16-bit
    dtype, at least 16 columns (the dot's smallest step), each row contiguous."""
    return (
        isinstance(weight, torch.Tensor)
        and x.dim() == 2
        and 2 <= x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[1] >= 16
    )


def pairs(weight: torch.Tensor) -> int:
    """Output pairs per program of the SILU and ROPE epilogues."""
    return _config(weight)[0] // 2


def _config(weight: torch.Tensor, rows: int = 1) -> tuple[int, int, int, int]:
    """The settings, the K step cut to K where K is shorter (rounded up to a power of two), and
    halved while a pipeline stage's tiles of W and x would take more than _STAGE_BYTES."""
    block_n, block_k, warps, stages = _SETTINGS
    block_k = min(block_k, triton.next_power_of_2(weight.shape[1]))
    while (block_n + _m_pad(rows)) * block_k * weight.element_size() > _STAGE_BYTES:
        block_k //= 2
    return block_n, block_k, warps, stages


def _m_pad(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def launch(
    x, weight, bias, epilogue=STORE, outputs=None, rope=None, norm=None, residual=None, config=None
) -> torch.Tensor:
    """y [M, outputs] = the epilogue of x @ weight.T + bias, where `applies(x, weight)`. rope:
    (cos, sin [M, half], half head_dim, rotated rows) for ROPE; norm: (h [M, K], eps), of which x
    is h times the norm's weight; residual: (residual [M, N], norm weight, scaled output) to add
    to a STORE's output; config: (rows of W per program, K step, warps, stages) in place of the
    shape's, for engine.gemv_bench's sweep."""
    assert applies(x, weight)
    (m, k), n = x.shape, weight.shape[0]
    block_n, block_k, num_warps, num_stages = config or _config(weight, m)
    y = torch.empty(m, outputs or n, dtype=x.dtype, device=x.device)
    cos, sin, half, rotated = rope if rope is not None else (y, y, 1, 0)  # read by ROPE only
    h, eps = norm if norm is not None else (x, 0.0)  # h read by NORM only
    assert norm is None or (h.shape == x.shape and h.is_contiguous())
    res, norm_w, scaled = residual if residual is not None else (y, y, y)  # read if residual
    pdl = triton_pdl.enabled(x.device)
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, cos, sin, h, eps, res, norm_w, scaled,
        m, n, k, x.stride(0), weight.stride(0), cos.stride(0), rotated,
        BLOCK_N=block_n, BLOCK_K=block_k, M_PAD=_m_pad(m),
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, EPILOGUE=epilogue, HALF=half,
        NORM=norm is not None, K_PAD=triton.next_power_of_2(k) if norm is not None else 1,
        RESIDUAL=residual is not None,
        # Triton's CPU interpreter (tests) multiplies bf16 tiles as their raw bits: widen first.
        WIDEN=not triton_device.compiled(x.device),
        PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return y


@triton.jit
def _rows_kernel(
    x_ptr,  # [M, K], rows stride_xm apart
    w_ptr,  # [N, K], rows stride_wn apart
    b_ptr,  # [N]
    y_ptr,  # [M, N] contiguous; [M, N / 2] for SILU
    cos_ptr,  # [M, HALF], rows stride_cm apart
    sin_ptr,  # [M, HALF], as cos
    h_ptr,  # [M, K] contiguous: NORM's h, of which x = h * norm weight
    eps,  # NORM's
    res_ptr,  # [M, N] contiguous: RESIDUAL's, added to the output
    norm_w_ptr,  # [N]: RESIDUAL's next norm weight
    scaled_ptr,  # [M, N]: RESIDUAL's output times norm_w
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_cm,
    rotated_rows,  # ROPE: rows [0, rotated_rows) are rotated, the rest stored as they are
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_PAD: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    K_PAD: tl.constexpr,
    RESIDUAL: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    PAIRS: tl.constexpr = BLOCK_N // 2
    rows, first, dim0 = program_rows(pid, N, BLOCK_N, EPILOGUE, HALF)
    inputs = tl.arange(0, M_PAD)
    # Rows of W past N (the last program's) re-read the last one: the weight's loads stay
    # unpredicated; only the store is masked. Inputs past M are masked whole (zeros, no request:
    # each program reads x at every K step, from L2, and 16 padded rows would be as many bytes
    # as its weight tile).
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + tl.minimum(inputs, M - 1).to(tl.int64)[None, :] * stride_xm
    in_m = (inputs < M)[None, :]
    cols = tl.arange(0, BLOCK_K)
    w = weight_tile(w_rows, cols, K, EVEN_K)  # requested before the wait: no kernel writes W
    triton_pdl.await_previous_kernel(PDL)
    if NORM:
        inv_rms = _inverse_rms(h_ptr, eps, M, K, inputs, M_PAD, K_PAD)
    x = tl.load(x_rows + cols[:, None], mask=(cols < K)[:, None] & in_m, other=0.0)
    acc = _dot(w, x, tl.zeros([BLOCK_N, M_PAD], tl.float32), WIDEN)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_rows + (k + cols)[None, :], eviction_policy="evict_first")
            x = tl.load(x_rows + (k + cols)[:, None], mask=in_m, other=0.0)
        else:
            in_k = k + cols < K
            w = tl.load(w_rows + (k + cols)[None, :], mask=in_k[None, :], other=0.0)
            x = tl.load(x_rows + (k + cols)[:, None], mask=in_k[:, None] & in_m, other=0.0)
        acc = _dot(w, x, acc, WIDEN)
    if NORM:
        acc *= inv_rms[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)[:, None]
    dtype = y_ptr.dtype.element_ty
    y = acc.to(dtype)  # the projection's output, rounded as a separate op would receive it
    if EPILOGUE == 1:
        gate, up = _split_pairs(y, PAIRS, M_PAD)
        g32 = gate.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(dtype).to(tl.float32)
        outs = pid * PAIRS + tl.arange(0, PAIRS)
        out = y_ptr + inputs[None, :].to(tl.int64) * (N // 2) + outs[:, None]
        tl.store(out, (silu * up.to(tl.float32)).to(dtype), mask=in_m)
    elif EPILOGUE == 2:
        x1, x2 = _split_pairs(y, PAIRS, M_PAD)
        dims = dim0 + tl.arange(0, PAIRS)
        at = tl.minimum(inputs, M - 1)[None, :] * stride_cm + dims[:, None]
        cos = tl.load(cos_ptr + at).to(tl.float32)
        sin = tl.load(sin_ptr + at).to(tl.float32)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        out1, out2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
        rotated = tl.reshape(tl.permute(tl.join(out1, out2), (0, 2, 1)), [BLOCK_N, M_PAD])
        out = y_ptr + inputs[None, :].to(tl.int64) * N + rows[:, None]
        tl.store(out, tl.where(first < rotated_rows, rotated, y), mask=in_m)
    else:
        at = inputs[None, :].to(tl.int64) * N + rows[:, None]
        in_both = (rows < N)[:, None] & in_m
        if RESIDUAL:  # the residual stream, rounded after the add as a separate add rounds it
            residual = tl.load(res_ptr + at, mask=in_both, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) + residual).to(dtype)
            norm_w = tl.load(norm_w_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
            tl.store(scaled_ptr + at, (y.to(tl.float32) * norm_w[:, None]).to(dtype), mask=in_both)
        tl.store(y_ptr + at, y, mask=in_both)


@triton.jit
def program_rows(pid, N, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr, HALF: tl.constexpr):
    """(the BLOCK_N weight rows program `pid` owns; for ROPE, the first of them, and the first
    of the head's dimensions they rotate). STORE: consecutive rows. SILU and ROPE: row j is the
    first (j even) or second (j odd) of pair j // 2, so that a [PAIRS, 2] split takes the pairs
    apart: SILU's gate row r and up row N / 2 + r, ROPE's row d and row d + HALF of one head.
    The GEMV's (engine.triton_linear) and this module's kernel."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    pair = tl.arange(0, BLOCK_N) // 2
    second = tl.arange(0, BLOCK_N) % 2
    first = pid * 0  # scalars of one type in every branch (read by ROPE only)
    dim0 = pid * 0
    if EPILOGUE == 1:
        rows = pid * PAIRS + pair + second * (N // 2)
    elif EPILOGUE == 2:
        per_head: tl.constexpr = HALF // PAIRS
        dim0 = (pid % per_head) * PAIRS
        first = (pid // per_head) * (2 * HALF) + dim0
        rows = first + pair + second * HALF
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, first, dim0


@triton.jit
def weight_tile(w_rows, cols, K, EVEN_K: tl.constexpr):
    """The first K step of the weight rows (pointers [BLOCK_N, 1]): unpredicated where K is a
    whole number of steps, streamed past L2 (read once)."""
    if EVEN_K:
        return tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)


@triton.jit
def _dot(w, x, acc, WIDEN: tl.constexpr):
    if WIDEN:
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _inverse_rms(h_ptr, eps, M, K, inputs, M_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """[M_PAD]: 1 / rms of each row of h [M, K] (the last row's past M)."""
    whole = tl.arange(0, K_PAD)
    inv_rms = tl.zeros([M_PAD], tl.float32)
    for m in range(0, M):
        h = tl.load(h_ptr + m * K + whole, mask=whole < K, other=0.0).to(tl.float32)
        inv_rms = tl.where(inputs >= m, tl.rsqrt(tl.sum(h * h, 0) / K + eps), inv_rms)
    return inv_rms


@triton.jit
def _split_pairs(y, PAIRS: tl.constexpr, M_PAD: tl.constexpr):
    """y [2 * PAIRS, M_PAD], rows paired as the program's: the pairs' first and second rows."""
    return tl.split(tl.permute(tl.reshape(y, [PAIRS, 2, M_PAD]), (0, 2, 1)))
