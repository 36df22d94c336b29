"""Linear layers for decode on the GPU: a Triton GEMV for one-row inputs, cuBLAS otherwise.

A bs=1 decode step is a chain of matrix-vector products that stream every weight once, so
their bandwidth is the step's speed. cuBLAS's M=1 kernels leave bandwidth unused on the square
and short matrices (o_proj at ~61% of the measured read bandwidth on an H200, ~75% here:
engine.gemv_bench), and they cannot overlap their launch with the kernels around them, which
this one does (programmatic dependent launch, engine.triton_pdl). Figures: docs/performance.md.

`_gemv_kernel`, grid (N / BLOCK_N,): one program owns BLOCK_N whole rows of W and walks K in
BLOCK_K steps, multiplying in fp32 into a [BLOCK_N, BLOCK_K] accumulator that is summed once at
the end. Rows are many and short-lived programs (an 8B layer's matrices give 1,024 to 7,168),
so the hardware keeps several programs' loads in flight per SM without software pipelining.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import triton_pdl

__all__ = ["linear"]

# (rows per program, largest K step, warps), chosen on an H200 with engine.gemv_bench over the
# Llama-3-8B matrices (docs/performance.md): tall matrices (qkv, gate_up, lm_head) stream best
# with 8 rows and 8 warps a program, square and wide ones (o_proj, down_proj) with 4 and 4.
_TALL = (8, 1024, 8)
_OTHER = (4, 2048, 4)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with one-row CUDA inputs computed by the GEMV kernel."""
    if not _gemv_applies(x, weight):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    y = torch.empty(1, out_features, dtype=x.dtype, device=x.device)
    block_n, max_block_k, num_warps = _TALL if 2 * out_features >= 3 * in_features else _OTHER
    block_k = min(max_block_k, triton.next_power_of_2(in_features))
    pdl = triton_pdl.enabled(x.device)
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x,
        weight,
        bias if bias is not None else y,  # unread without HAS_BIAS
        y,
        out_features,
        in_features,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=in_features % block_k == 0,
        HAS_BIAS=bias is not None,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=1,
        launch_pdl=pdl,
    )
    return y


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and weight.stride(1) == 1
        and x.dtype == weight.dtype
    )


@triton.jit
def _gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [N, K], rows stride_wn apart
    b_ptr,  # [N]
    y_ptr,  # [1, N]
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N re-read the last row instead of masking: every load stays a full-width,
    # unpredicated vector load; only the store is masked.
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    cols = tl.arange(0, BLOCK_K)
    triton_pdl.await_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_rows + (k + cols)[None, :], eviction_policy="evict_first")
            x = tl.load(x_ptr + k + cols)
        else:
            in_k = k + cols < K
            w = tl.load(w_rows + (k + cols)[None, :], mask=in_k[None, :], other=0.0)
            x = tl.load(x_ptr + k + cols, mask=in_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)
