"""Matrix products of a few rows (2 to 64) on the GPU: a speculative verification's k + 1
positions, a small batch's decode step. Each weight tile is read once for all the rows.

Such a product is as memory-bound as the one-row GEMV (engine.triton_linear): its bytes are the
weight's. cuBLAS's kernels for these shapes stream it at 2.2-2.9 TB/s on an H100 where the GEMV
reaches 3.1 (docs/performance.md), so a verification of 4 positions cost about 1.3 plain steps
before its attention and heads were counted.

`_rows_kernel`, grid (N / BLOCK_N,): one program owns BLOCK_N whole rows of W and walks K in
BLOCK_K steps; at each, tl.dot multiplies its [BLOCK_N, BLOCK_K] weight tile by the rows' tile,
padded to a power of two of at least 16 (the dot's smallest width; the padding re-reads the last
row, from L2, so every load is unmasked), into an fp32 [BLOCK_N, M_PAD] accumulator. The
weight's first tile is requested before the kernel waits for the one before it (programmatic
dependent launch, as the GEMV), the rest pipelined by Triton (num_stages). The product is
rounded once, as F.linear's is.
"""

import torch
import triton
import triton.language as tl

from engine import triton_pdl

__all__ = ["MAX_ROWS", "applies", "linear"]

MAX_ROWS = 64
"""The most rows a product may have here; past it, cuBLAS's tiles read the weight once too."""

# (rows of W per program, K step, warps, pipeline stages) by the matrix's shape, N out of K in.
# TODO(device): chosen by `engine.gemv_bench --rows 4 --sweep` on an H100; see performance.md.
_TALL = (16, 256, 4, 4)
_OTHER = (16, 256, 4, 4)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes x @ weight.T: 2 to MAX_ROWS rows of a matrix's 16-bit
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


def _config(weight: torch.Tensor) -> tuple[int, int, int, int]:
    rows, columns = weight.shape
    block_n, block_k, warps, stages = _TALL if rows >= 2 * columns else _OTHER
    return block_n, min(block_k, triton.next_power_of_2(columns)), warps, stages


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, where `applies(x, weight)`; `config` overrides the shape's
    (rows of W per program, K step, warps, stages), for engine.gemv_bench's sweep."""
    assert applies(x, weight)
    block_n, block_k, num_warps, num_stages = config or _config(weight)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = triton_pdl.enabled(x.device)
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else y,  # unread without HAS_BIAS
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        M_PAD=max(16, triton.next_power_of_2(m)),
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        # Triton's CPU interpreter (tests) multiplies bf16 tiles as their raw bits: widen first.
        WIDEN=x.device.type != "cuda",
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return y


@triton.jit
def _rows_kernel(
    x_ptr,  # [M, K], rows stride_xm apart
    w_ptr,  # [N, K], rows stride_wn apart
    b_ptr,  # [N]
    y_ptr,  # [M, N], contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_PAD: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    inputs = tl.arange(0, M_PAD)
    # Rows past N (the last program's) and inputs past M re-read the last one: the loads stay
    # unpredicated; only the store is masked.
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + tl.minimum(inputs, M - 1).to(tl.int64)[None, :] * stride_xm
    cols = tl.arange(0, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
    triton_pdl.await_previous_kernel(PDL)
    x = tl.load(x_rows + cols[:, None], mask=(cols < K)[:, None], other=0.0)  # [BLOCK_K, M_PAD]
    acc = _dot(w, x, tl.zeros([BLOCK_N, M_PAD], tl.float32), WIDEN)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_rows + (k + cols)[None, :], eviction_policy="evict_first")
            x = tl.load(x_rows + (k + cols)[:, None])
        else:
            in_k = k + cols < K
            w = tl.load(w_rows + (k + cols)[None, :], mask=in_k[None, :], other=0.0)
            x = tl.load(x_rows + (k + cols)[:, None], mask=in_k[:, None], other=0.0)
        acc = _dot(w, x, acc, WIDEN)
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)[:, None]
    out = y_ptr + inputs[None, :].to(tl.int64) * N + rows[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (inputs < M)[None, :])


@triton.jit
def _dot(w, x, acc, WIDEN: tl.constexpr):
    if WIDEN:
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x, acc)
