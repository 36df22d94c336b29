"""x @ W.T for an fp8 matrix W (engine.fp8.Fp8Weight) and inputs of several rows: decode
batches and prefill chunks, on the GPU.

`_fp8_gemm_kernel`, grid (M / BLOCK_M, N / BLOCK_N, splits), computes W x^T: W's rows are the
tensor-core instruction's M side (64 a warpgroup), the batch its N side (16 will do). Where K
steps by 128 columns (block_k a multiple of 128, or one scale per row), each program quantizes
its rows of x per 128-column group (e4m3, the group's largest magnitude mapped to 448: DeepSeek-
V3's and vLLM's scheme, `quantizes_activations`) and multiplies e4m3 by e4m3 straight from
shared memory; the partial product of a K step is scaled by x's group scales and W's block
scale. Other block sizes (a step must lie within one scale block) convert W's tile to the
compute dtype (exact) and leave x unquantized. So a batch's product differs from the one-row
GEMV's (engine.triton_linear, x unquantized) by x's rounding to e4m3.

Decode batches are bound by the weight bytes: a batch fills one row tile, so the programs along
N alone are too few to keep every SM streaming (32 for a 4096-row matrix in 128-row tiles); K
is split among programs until there are about two waves of them, each storing its fp32 partial
product, and `_sum_splits_kernel` adds them (and the bias) in a fixed order, so results do not
vary from run to run.

Prefill chunks (`DEQUANTIZED_ROWS` rows or more) are bound by the tensor cores, where the
kernel's per-tile work costs more than a pass over W (measured on an H200: docs/performance.md):
`_dequantize_kernel` writes W in the compute dtype (q * s rounded once) and cuBLAS multiplies,
at bf16's throughput.
"""

import torch
import triton
import triton.language as tl

from engine import triton_device
from engine.fp8 import Fp8Weight

__all__ = ["applies", "choose_splits", "dequantize", "linear", "quantizes_activations"]

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_MAX_BLOCK_K = 128
DEQUANTIZED_ROWS = 128
# Columns of an activation row that share one fp8 scale (DeepSeek-V3's and vLLM's group).
ACTIVATION_GROUP = 128
_DEQUANTIZE_ROWS_PER_PROGRAM = 64


def _k_step(weight: Fp8Weight) -> int | None:
    """BLOCK_K: a power of two >= 16 that divides the scale block (None if there is none), or
    the largest step where one scale covers each row's K."""
    in_features = weight.shape[-1]
    if weight.block_k >= in_features:
        return min(_MAX_BLOCK_K, max(_MIN_DOT, triton.next_power_of_2(in_features)))
    step = weight.block_k & -weight.block_k  # its largest power-of-two divisor
    step = min(step, _MAX_BLOCK_K)
    return step if step >= _MIN_DOT else None


def applies(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether the kernel computes x @ weight.T: x [M, K] in a compute dtype, a 2-D matrix
    with rows contiguous, and a K step the scale blocks allow."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.weight.dim() == 2
        and weight.weight.stride(1) == 1
        and weight.scale.stride(1) == 1
        and _k_step(weight) is not None
    )


def linear(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """x @ dequantized(weight).T + bias, for x [M, K] (x through e4m3 where
    `quantizes_activations`); through the dense matrix where the kernel does not apply
    (correct, not fast). `splits` overrides how many parts K is split
    into (tests and tuning); None picks it with `choose_splits`."""
    if not applies(x, weight):
        return torch.nn.functional.linear(x, weight.dense(x.dtype), bias)
    rows, columns = x.shape
    out_features, in_features = weight.shape
    assert columns == in_features, (x.shape, weight.shape)
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    if rows >= DEQUANTIZED_ROWS:
        return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)
    block_m, block_n, num_warps, num_stages = _config(rows, out_features)
    block_k = _k_step(weight)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(out_features, block_n)
    k_steps = triton.cdiv(in_features, block_k)
    if splits is None:
        sms = triton_device.sm_count(x.device)
        splits = choose_splits(tiles, k_steps, sms) if rows <= 64 else 1
    if not 1 <= splits <= k_steps:
        raise ValueError(f"splits must be in [1, {k_steps}] (the K steps), got {splits}")
    steps_per_split = triton.cdiv(k_steps, splits)
    splits = triton.cdiv(k_steps, steps_per_split)  # none left without steps
    out = y if splits == 1 else torch.empty(splits, rows, out_features, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), splits)
    _fp8_gemm_kernel[grid](
        x, weight.weight, weight.scale, bias if bias is not None else y, out,
        rows, out_features, in_features, steps_per_split * block_k,
        x.stride(0), x.stride(1), weight.weight.stride(0), weight.scale.stride(0),
        out.stride(-2), out.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # A scale per (row, block_k columns); 0: one scale per row, applied at the end.
        SCALE_K=weight.block_k if weight.block_k < in_features else 0,
        HAS_BIAS=bias is not None and splits == 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        QUANTIZE_X=quantizes_activations(x, weight),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        block = min(1024, triton.next_power_of_2(out_features))
        _sum_splits_kernel[(rows, triton.cdiv(out_features, block))](
            out, bias if bias is not None else y, y, out_features,
            out.stride(0), out.stride(1), y.stride(0),
            SPLITS=splits, BLOCK=block, HAS_BIAS=bias is not None,
        )  # fmt: skip
    return y


def quantizes_activations(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether `linear` quantizes x (e4m3, a scale per ACTIVATION_GROUP columns of a row) and
    multiplies in fp8: batches of 2 to DEQUANTIZED_ROWS - 1 rows, where K steps by the group."""
    return (
        applies(x, weight)
        and 1 < x.shape[0] < DEQUANTIZED_ROWS
        and _k_step(weight) == ACTIVATION_GROUP
    )


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """weight.dense(dtype) in one kernel: q * s in fp32, rounded once (where `applies`)."""
    out_features, in_features = weight.shape
    dense = torch.empty(out_features, in_features, dtype=dtype, device=weight.weight.device)
    block_k = _k_step(weight)
    grid = (
        triton.cdiv(out_features, _DEQUANTIZE_ROWS_PER_PROGRAM),
        triton.cdiv(in_features, block_k),
    )
    _dequantize_kernel[grid](
        weight.weight, weight.scale, dense, out_features, in_features,
        weight.weight.stride(0), weight.scale.stride(0), dense.stride(0),
        BLOCK_N=_DEQUANTIZE_ROWS_PER_PROGRAM, BLOCK_K=block_k,
        SCALE_K=weight.block_k if weight.block_k < in_features else 0,
    )  # fmt: skip
    return dense


def choose_splits(tiles: int, k_steps: int, sm_count: int) -> int:
    """Parts K is split into: enough programs for about two waves of the SMs, each part at
    least four K steps long."""
    wanted = -(-2 * sm_count // tiles)
    return max(1, min(wanted, k_steps // 4))


def _config(rows: int, out_features: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, pipeline stages): for batches of up to 16 and 64 rows the best
    of 8 each, timed on an H200 over Llama-3-8B's layer matrices (docs/performance.md); larger
    ones (below DEQUANTIZED_ROWS) take square tiles, untimed."""
    if rows <= 16:
        return _MIN_DOT, 64, 4, 4
    if rows <= 64:
        return triton.next_power_of_2(rows), 128, 8, 3
    return 128, 128, 8, 3


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K] compute dtype
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [N, KB] float32: row n's scale of each K block
    b_ptr,  # [N]: HAS_BIAS's
    y_ptr,  # [M, N] compute dtype; with several splits [splits, M, N] fp32 partials
    M,
    N,
    K,
    split_k,  # columns of K each split covers (a multiple of BLOCK_K)
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_ys,  # between splits' partials
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides SCALE_K
    SCALE_K: tl.constexpr,  # columns of a scale block; 0: one scale per row
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANTIZE_X: tl.constexpr,  # x quantized per BLOCK_K columns of a row, fp8 dots
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edges re-read the last one (full-width loads); only the store
    # is masked.
    x_rows = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn
    s_cols = s_ptr + tl.minimum(cols, N - 1).to(tl.int64) * stride_sn
    ks = tl.arange(0, BLOCK_K)
    compute = x_ptr.dtype.element_ty
    # Computed transposed, W x^T: W's rows are the dot's M side (64 or more a warpgroup's
    # instruction takes), the batch its N side (16 will do).
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(split * split_k, tl.minimum(K, (split + 1) * split_k), BLOCK_K):
        in_k = k + ks < K
        x = tl.load(x_rows + (k + ks)[None, :] * stride_xk, mask=in_k[None, :], other=0.0)
        w = tl.load(w_cols + (k + ks)[None, :], mask=in_k[None, :], other=0.0)  # [N, BLOCK_K]
        if QUANTIZE_X:  # each row's group scaled so that its largest magnitude maps to 448
            x_f32 = x.to(tl.float32)
            x_scale = tl.maximum(tl.max(tl.abs(x_f32), 1), 1e-12) / 448.0
            x_fp8 = (x_f32 / x_scale[:, None]).to(tl.float8e4nv)
            part = tl.dot(w, tl.trans(x_fp8)) * x_scale[None, :]
        else:
            part = tl.dot(w.to(compute), tl.trans(x), input_precision=PRECISION)
        if SCALE_K == 0:
            acc += part
        else:
            acc += part * tl.load(s_cols + k // SCALE_K)[:, None]
    if SCALE_K == 0:
        acc *= tl.load(s_cols)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(cols, N - 1)).to(tl.float32)[:, None]
    mask = (cols < N)[:, None] & (rows < M)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)  # fp32 partials stay fp32
    y_cols = y_ptr + split * stride_ys + rows.to(tl.int64)[None, :] * stride_ym
    tl.store(y_cols + cols[:, None], y, mask=mask)


@triton.jit
def _sum_splits_kernel(
    partial_ptr,  # [SPLITS, M, N] fp32
    b_ptr,  # [N]: HAS_BIAS's
    y_ptr,  # [M, N]
    N,
    stride_ps,
    stride_pm,
    stride_ym,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_n = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + split * stride_ps + row * stride_pm + cols, mask=in_n)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=in_n).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def _dequantize_kernel(
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [N, KB] float32
    out_ptr,  # [N, K] compute dtype
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides SCALE_K
    SCALE_K: tl.constexpr,  # 0: one scale per row
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K
    cols = k + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    q = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    block = 0 if SCALE_K == 0 else k // SCALE_K
    scale = tl.load(s_ptr + rows64 * stride_sn + block, mask=rows < N, other=0.0)
    dense = (q.to(tl.float32) * scale[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * stride_on + cols[None, :], dense, mask=mask)
