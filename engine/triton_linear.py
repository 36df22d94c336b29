"""Linear layers for decode on the GPU: a Triton GEMV for one-row inputs, a few-row kernel
(engine.triton_gemv_rows) for 2 to ROWS_KERNEL_MAX_ROWS rows of the matrices it streams faster
than cuBLAS, cuBLAS otherwise.

A bs=1 decode step is a chain of matrix-vector products that stream every weight once, so
their bandwidth is the step's speed. cuBLAS's M=1 kernels leave bandwidth unused on the square
and short matrices (o_proj at ~61% of the measured read bandwidth on an H200, ~87% here:
engine.gemv_bench), and they cannot overlap their launch with the kernels around them, which
this one does (programmatic dependent launch, engine.triton_pdl). Figures: docs/performance.md.

`_gemv_kernel`, grid (N / BLOCK_N,): one program owns BLOCK_N whole rows of W and walks K in
BLOCK_K steps, multiplying in fp32 into a [BLOCK_N, BLOCK_K] accumulator that is summed once at
the end. Rows are many and short-lived programs (an 8B layer's matrices give 384 to 1,792),
so the hardware keeps several programs' loads in flight per SM without software pipelining.
A program requests its first weight tile *before* waiting for the previous kernel: weights do
not depend on it, so HBM keeps streaming while the kernels before finish.

Two elementwise ops that follow a projection are done in the GEMV's epilogue, on the rounded
outputs exactly as the separate kernels (engine.triton_ops) would, so that they cost no kernel
of their own. Callers check `fuses_silu` / `fuses_rope` first (engine.cuda_ops).
- `linear_silu`: SwiGLU on gate_up_proj. A program owns BLOCK_N / 2 gate rows and the up rows
  paired with them, and stores silu(gate) * up.
- `linear_rope`: RoPE on the q and k part of qkv_proj. A program owns BLOCK_N / 2 dimensions of
  one head's first half and the same dimensions of its second half, the pairs RoPE rotates
  together (half-split pairing, engine.model.apply_rotary).

FP8 weights (engine.fp8.Fp8Weight) are read as they are stored, half the bytes of bf16, and
scaled in fp32 as engine.triton_fp8_scales says; activations stay in the compute dtype, so the
product is that of the dequantized matrix. Inputs of several rows, and block sizes the GEMV
cannot step by, go to engine.triton_fp8_gemm.

The residual add and RMSNorm between the projections cost no kernel either:
- `linear_residual` (o_proj, down_proj) adds the residual to its rounded outputs, as a
  separate add would, and also stores the sum times the next norm's weight;
- that product is the input of the next GEMV (qkv_proj, gate_up_proj), which takes the mean
  square of the sum in one pass before its K loop and scales its dot products by 1 / rms at
  the end (`Prenorm`). The normalized input is never rounded, so results differ from the
  norm's own kernel in the last bits, no further from float64.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import triton_fp8_gemm, triton_fp8_scales, triton_gemv_rows, triton_pdl
from engine.fp8 import Fp8Weight, Matrix

__all__ = [
    "Prenorm",
    "fuses",
    "fuses_rope",
    "fuses_silu",
    "gemv_applies",
    "linear",
    "linear_residual",
    "linear_rope",
    "linear_silu",
]

ROWS_KERNEL_MAX_ROWS = 4
"""Products of 2 to this many rows of a matrix that is not very tall (qkv_proj, o_proj,
down_proj: N < 3K) run engine.triton_gemv_rows, epilogues included, instead of cuBLAS and the
separate kernels. Timed in Llama-3-8B's steps on an H100 (docs/performance.md): plain decode
gained 4.1% at 2 rows, 3.7% at 4 and 4.6% at 8, an EAGLE-3 verification 3.1% at 4 rows (bs=1)
but lost 2.8% at 8 (bs=2). Very tall matrices (gate_up, lm_head) stay with cuBLAS, whose tiles
stream them faster at these rows: with them the kernel lost 3.5% at 8 rows and 27% at 32."""
ROWS_KERNEL_VERY_TALL = False
"""Whether very tall matrices take the few-row kernel too (its tests set this, and
ROWS_KERNEL_MAX_ROWS to triton_gemv_rows.MAX_ROWS)."""

# (rows per program, largest K step, warps) by the matrix's class (`_shape_class`), chosen in
# the engine's own bs=1 decode step of Llama-3-8B, where each GEMV overlaps the kernels around
# it (its first tile is requested while they finish); docs/performance.md. bf16, on an H200:
# very tall matrices (gate_up, lm_head) with 16 rows and 8 warps a program, tall ones (qkv)
# with 16 rows in short steps, square and wide ones (o_proj, down_proj) with 4 rows and 4 warps
# (streaming each shape alone had chosen fewer rows for very tall, square and wide matrices,
# 2.1% slower in the step).
_CONFIGS = {"very tall": (16, 1024, 8), "tall": (16, 512, 8), "square": (4, 1024, 4)}
_CONFIGS["wide"] = _CONFIGS["square"]
# FP8: the very tall and tall sets the best of 7 timed on an H200 (each from a sweep of 24 per
# shape streamed alone); the square and wide ones, which had shared (8, 2048, 8) there, each the
# best of 11 timed apart on an H100 (+6% in the fp8 step), where the very tall and tall ones
# stayed the best of 7 each.
_FP8_CONFIGS = {
    "very tall": (8, 2048, 4),
    "tall": (16, 1024, 8),
    "square": (4, 2048, 4),
    "wide": (2, 2048, 4),
}

# What the kernel does with its rounded outputs (the EPILOGUE constexpr), as the few-row one.
_STORE, _SILU, _ROPE = triton_gemv_rows.STORE, triton_gemv_rows.SILU, triton_gemv_rows.ROPE


class Prenorm(NamedTuple):
    """The RMSNorm before a projection, done by the GEMV: its input is x = h * norm weight (as
    `linear_residual` stores it), and it scales its dot products by 1 / rms(h) at the end, so
    that the product is of rms_norm(h) * norm weight. Every program reads the whole of h once
    (from L2) for its mean square before it starts on K; that costs less than a kernel of its
    own for the norm, and a second vector read at every K step would cost more
    (docs/performance.md)."""

    h: torch.Tensor
    eps: float


def linear(
    x: torch.Tensor,
    weight: Matrix,
    bias: torch.Tensor | None = None,
    norm: Prenorm | None = None,
) -> torch.Tensor:
    """F.linear, with one-row CUDA inputs computed by the GEMV kernel (which applies `norm`
    where given: x is then the scaled input), a few rows by engine.triton_gemv_rows, and fp8
    matrices by engine.triton_fp8_gemm otherwise."""
    if gemv_applies(x, weight):
        return _gemv(x, weight, bias, _STORE, weight.shape[0], norm=norm)
    if _rows_kernel_applies(x, weight):
        return triton_gemv_rows.launch(x, weight, bias, norm=_rows_norm(norm))
    assert norm is None, "a Prenorm needs the GEMV or the few-row kernel: check fuses first"
    if isinstance(weight, Fp8Weight):
        return triton_fp8_gemm.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_residual(
    x: torch.Tensor, weight: Matrix, residual: torch.Tensor, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x @ weight.T + residual (each rounded, as a separate add would be), and h * norm_weight
    for a `Prenorm` product after it, where `fuses(x, weight)`."""
    assert residual.shape == (x.shape[0], weight.shape[0]) and residual.is_contiguous()
    scaled = torch.empty_like(residual)
    if x.shape[0] > 1:
        residual_ops = (residual, norm_weight, scaled)
        return triton_gemv_rows.launch(x, weight, None, residual=residual_ops), scaled
    h = _gemv(x, weight, None, _STORE, weight.shape[0], residual=(residual, norm_weight, scaled))
    return h, scaled


def fuses(x: torch.Tensor, weight: Matrix) -> bool:
    """Whether a kernel of this module computes x @ weight.T with the ops around it (a `Prenorm`,
    `linear_residual`): the GEMV for one row, the few-row kernel for a few."""
    return gemv_applies(x, weight) or _rows_kernel_applies(x, weight)


def _rows_kernel_applies(x: torch.Tensor, weight: Matrix) -> bool:
    return (
        triton_gemv_rows.applies(x, weight)
        and x.shape[0] <= ROWS_KERNEL_MAX_ROWS
        and (ROWS_KERNEL_VERY_TALL or not _very_tall(weight))
    )


def fuses_silu(x: torch.Tensor, weight: Matrix) -> bool:
    """Whether `linear_silu` applies: `fuses`, and gate rows in whole programs."""
    return fuses(x, weight) and (weight.shape[0] // 2) % _pairs(x, weight) == 0


def linear_silu(x: torch.Tensor, weight: Matrix, norm: Prenorm | None = None) -> torch.Tensor:
    """silu(gate) * up of [gate | up] = x @ weight.T, where `fuses_silu(x, weight)`."""
    if x.shape[0] > 1:
        return triton_gemv_rows.launch(
            x, weight, None, triton_gemv_rows.SILU, weight.shape[0] // 2, norm=_rows_norm(norm)
        )
    return _gemv(x, weight, None, _SILU, weight.shape[0] // 2, norm=norm)


def fuses_rope(x: torch.Tensor, weight: Matrix, head_dim: int) -> bool:
    """Whether `linear_rope` applies: `fuses`, and half-heads in whole programs."""
    return (
        fuses(x, weight)
        and (head_dim // 2) % _pairs(x, weight) == 0
        and weight.shape[0] % head_dim == 0
    )


def linear_rope(
    x: torch.Tensor,
    weight: Matrix,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    rotated_features: int,
    norm: Prenorm | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, its first `rotated_features` outputs (whole heads) of each row i
    rotated by cos[i], sin[i] [head_dim / 2], where `fuses_rope(x, weight, head_dim)`."""
    assert rotated_features % head_dim == 0 and cos.is_contiguous() and sin.is_contiguous()
    rope = (cos, sin, head_dim // 2, rotated_features)
    if x.shape[0] > 1:
        assert cos.shape == sin.shape == (x.shape[0], head_dim // 2)
        return triton_gemv_rows.launch(
            x, weight, bias, triton_gemv_rows.ROPE, rope=rope, norm=_rows_norm(norm)
        )
    return _gemv(x, weight, bias, _ROPE, weight.shape[0], rope=rope, norm=norm)


def _config(weight: Matrix) -> tuple[int, int, int]:
    """(rows per program, largest K step, warps) of a matrix."""
    configs = _FP8_CONFIGS if isinstance(weight, Fp8Weight) else _CONFIGS
    return configs[_shape_class(weight)]


def _shape_class(weight: Matrix) -> str:
    """N out of K in: very tall (N >= 3K: gate_up, lm_head), tall (N >= 1.5K: qkv), wide
    (N < K: down_proj) or square (o_proj)."""
    rows, columns = weight.shape
    if _very_tall(weight):
        return "very tall"
    if 2 * rows >= 3 * columns:
        return "tall"
    return "wide" if rows < columns else "square"


def _very_tall(weight: Matrix) -> bool:
    """N >= 3K: gate_up_proj, lm_head."""
    rows, columns = weight.shape
    return rows >= 3 * columns


def _pairs(x: torch.Tensor, weight: Matrix) -> int:
    """Output pairs per program of the SILU and ROPE epilogues, the GEMV's or the few-row
    kernel's."""
    return _config(weight)[0] // 2 if x.shape[0] == 1 else triton_gemv_rows.pairs(weight)


def _rows_norm(norm: Prenorm | None) -> tuple[torch.Tensor, float] | None:
    return None if norm is None else (norm.h, norm.eps)


def _block_k(weight: Matrix) -> int:
    """The K step: the config's, or all of K if it is shorter (rounded up to a power of two)."""
    return min(_config(weight)[1], triton.next_power_of_2(weight.shape[1]))


def _scaling(weight: Matrix) -> int | None:
    """The SCALES mode of a matrix, or None where the GEMV cannot step by its scale blocks."""
    return triton_fp8_scales.scaling(weight, _block_k(weight))


def gemv_applies(x: torch.Tensor, weight: Matrix) -> bool:
    """Whether the GEMV computes x @ weight.T: one contiguous row of the weight's dtype (of the
    compute dtype for an fp8 matrix whose scale blocks it can step by)."""
    if isinstance(weight, Fp8Weight):
        values, compute = weight.weight, x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        compute = compute and weight.scale.is_contiguous() and _scaling(weight) is not None
    else:
        values, compute = weight, x.dtype == weight.dtype
    return (
        x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and values.stride(1) == 1 and compute
    )


def _gemv(x, weight, bias, epilogue, outputs, rope=None, norm=None, residual=None):
    """The kernel's launch. rope: (cos, sin, half head_dim, rotated rows) for _ROPE; norm: a
    Prenorm; residual: (residual, norm weight, scaled output) to add to a _STORE's output."""
    assert gemv_applies(x, weight)
    block_k = _block_k(weight)
    block_n, _, num_warps = _config(weight)
    scales = triton_fp8_scales.constexprs(weight, block_k)
    weight, scale = triton_fp8_scales.operands(weight)
    rows, columns = weight.shape
    y = torch.empty(1, outputs, dtype=x.dtype, device=x.device)
    cos, sin, half, rotated = rope if rope is not None else (y, y, 1, 0)  # read by _ROPE only
    if norm is not None:
        assert norm.h.shape == x.shape and norm.h.is_contiguous()
    res, norm_w, scaled = residual if residual is not None else (y, y, y)  # read if residual
    pdl = triton_pdl.enabled(x.device)
    _gemv_kernel[(triton.cdiv(rows, block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else y,  # unread without HAS_BIAS
        y,
        cos,
        sin,
        norm.h if norm is not None else x,
        norm.eps if norm is not None else 0.0,
        res,
        norm_w,
        scaled,
        rows,
        columns,
        weight.stride(0),
        scale.stride(0),
        scale.shape[-1],
        rotated,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=columns % block_k == 0,
        HAS_BIAS=bias is not None,
        EPILOGUE=epilogue,
        **scales,
        HALF=half,
        NORM=norm is not None,
        # Only NORM reads it: a constant otherwise, so shapes of one kind share a compile.
        K_PAD=triton.next_power_of_2(columns) if norm is not None else 1,
        RESIDUAL=residual is not None,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=1,
        launch_pdl=pdl,
    )
    return y


@triton.jit
def _gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [N, K], rows stride_wn apart
    s_ptr,  # [N, KB] float32, rows stride_sn apart: SCALES' scale of each row's K blocks
    b_ptr,  # [N]
    y_ptr,  # [1, N]; [1, N / 2] for _SILU
    cos_ptr,  # [1, HALF]
    sin_ptr,  # [1, HALF]
    h_ptr,  # [1, K]: NORM's h, of which x = h * norm weight
    eps,  # NORM's
    res_ptr,  # [1, N]: RESIDUAL's, added to the output
    norm_w_ptr,  # [N]: RESIDUAL's next norm weight
    scaled_ptr,  # [1, N]: RESIDUAL's output times norm_w
    N,
    K,
    stride_wn,
    stride_sn,
    KB,  # scale blocks of a row
    rotated_rows,  # _ROPE: rows [0, rotated_rows) are rotated, the rest stored as they are
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    SCALES: tl.constexpr,  # UNSCALED, ROW_SCALED or BLOCK_SCALED (engine.triton_fp8_scales)
    SCALE_K: tl.constexpr,  # BLOCK_SCALED: columns of a scale block, a divisor of BLOCK_K
    HALF: tl.constexpr,  # _ROPE: half a head's width
    NORM: tl.constexpr,  # the product is scaled by 1 / rms(h)
    K_PAD: tl.constexpr,  # NORM: K rounded up to a power of two
    RESIDUAL: tl.constexpr,  # _STORE: the output is x @ W.T + residual; also stores its scaled
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    PAIRS: tl.constexpr = BLOCK_N // 2
    rows, first, dim0 = triton_gemv_rows.program_rows(pid, N, BLOCK_N, EPILOGUE, HALF)
    # Rows past N (_STORE's last program) re-read the last row instead of masking: every load
    # stays a full-width, unpredicated vector load; only the store is masked.
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + tl.minimum(rows, N - 1).to(tl.int64) * stride_sn
    cols = tl.arange(0, BLOCK_K)
    w = triton_gemv_rows.weight_tile(w_rows, cols, K, EVEN_K)  # before the wait: no kernel writes W
    triton_pdl.await_previous_kernel(PDL)
    if NORM:  # the mean square of h, whole, before the first K step
        whole = tl.arange(0, K_PAD)
        if K_PAD == K:
            h = tl.load(h_ptr + whole).to(tl.float32)
        else:
            h = tl.load(h_ptr + whole, mask=whole < K, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    acc = triton_fp8_scales.scaled_products(w, x, s_rows, 0, KB, SCALES, BLOCK_N, BLOCK_K, SCALE_K)
    for k in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_rows + (k + cols)[None, :], eviction_policy="evict_first")
            x = tl.load(x_ptr + k + cols)
        else:
            in_k = k + cols < K
            w = tl.load(w_rows + (k + cols)[None, :], mask=in_k[None, :], other=0.0)
            x = tl.load(x_ptr + k + cols, mask=in_k, other=0.0)
        acc += triton_fp8_scales.scaled_products(
            w, x, s_rows, k, KB, SCALES, BLOCK_N, BLOCK_K, SCALE_K
        )
    y = tl.sum(acc, 1)
    if SCALES == 1:  # ROW_SCALED
        y *= tl.load(s_rows)
    if NORM:
        y *= inv_rms
    if HAS_BIAS:
        y += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    y = y.to(dtype)  # the projection's output, rounded as a separate op would receive it
    if EPILOGUE == 1:
        gate, up = tl.split(tl.reshape(y, [PAIRS, 2]))
        g32 = gate.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(dtype).to(tl.float32)
        tl.store(y_ptr + pid * PAIRS + tl.arange(0, PAIRS), (silu * up.to(tl.float32)).to(dtype))
    elif EPILOGUE == 2:
        x1, x2 = tl.split(tl.reshape(y, [PAIRS, 2]))
        dims = dim0 + tl.arange(0, PAIRS)
        cos = tl.load(cos_ptr + dims).to(tl.float32)
        sin = tl.load(sin_ptr + dims).to(tl.float32)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        out1, out2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
        rotated = tl.reshape(tl.join(out1, out2), [BLOCK_N])
        tl.store(y_ptr + rows, tl.where(first < rotated_rows, rotated, y))
    else:
        if RESIDUAL:  # the residual stream, rounded after the add as a separate add rounds it
            in_n = rows < N
            residual = tl.load(res_ptr + rows, mask=in_n, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) + residual).to(dtype)
            norm_w = tl.load(norm_w_ptr + rows, mask=in_n, other=0.0).to(tl.float32)
            tl.store(scaled_ptr + rows, (y.to(tl.float32) * norm_w).to(dtype), mask=in_n)
        tl.store(y_ptr + rows, y, mask=rows < N)
