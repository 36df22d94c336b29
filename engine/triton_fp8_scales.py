"""How the GEMV-style kernels apply an fp8 matrix's scales (engine.fp8.Fp8Weight: e4m3 values,
a float32 scale per row and block of `block_k` columns) while they stream it: engine.triton_linear's
GEMV and engine.triton_moe_gemv's experts.

Each K step's products are summed per scale block (a register reshape: block_k a power of two
dividing the step) and each sum is multiplied by its block's scale; a scale per row (one block
spans K) is applied once, to the row's dot product. Activations stay in the compute dtype, so the
product is that of the dequantized matrix.
"""

import torch
import triton
import triton.language as tl

from engine.fp8 import Fp8Weight, Matrix

UNSCALED, ROW_SCALED, BLOCK_SCALED = 0, 1, 2
"""The SCALES constexpr: a weight tensor (no scales), one scale a row, or one per SCALE_K
columns of a row."""


def scaling(weight: Matrix, step: int) -> int | None:
    """The SCALES mode of a matrix streamed in K steps of `step` columns, or None where a kernel
    cannot step by its scale blocks (block_k not a power of two dividing the step)."""
    if not isinstance(weight, Fp8Weight):
        return UNSCALED
    if weight.block_k >= weight.shape[-1]:
        return ROW_SCALED
    power_of_two = weight.block_k & (weight.block_k - 1) == 0
    return BLOCK_SCALED if power_of_two and step % weight.block_k == 0 else None


def operands(weight: Matrix) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) as the kernels take a matrix: an fp8 one's e4m3 values [..., N, K] and
    row-wise scales [..., N, KB] (each row's contiguous); a weight tensor twice (its "scales"
    are never read)."""
    if isinstance(weight, Fp8Weight):
        assert weight.scale.stride(-1) == 1, "each row's scales contiguous"
        return weight.weight, weight.scale
    return weight, weight


def constexprs(weight: Matrix, step: int) -> dict:
    """The SCALES and SCALE_K constexprs of a matrix streamed in K steps of `step` columns."""
    mode = scaling(weight, step)
    return dict(SCALES=mode, SCALE_K=weight.block_k if mode == BLOCK_SCALED else 1)


@triton.jit
def scaled_products(
    w, x, s_rows, k, KB,
    SCALES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    """One K step's products w * x [BLOCK_N, BLOCK_K] in fp32, to be summed over columns;
    BLOCK_SCALED: summed per scale block and scaled, [BLOCK_N, BLOCK_K / SCALE_K]. s_rows: the
    rows' scale pointers [BLOCK_N] (each row's KB scales contiguous)."""
    products = w.to(tl.float32) * x.to(tl.float32)[None, :]
    if SCALES == 2:  # BLOCK_SCALED
        BLOCKS: tl.constexpr = BLOCK_K // SCALE_K
        sums = tl.sum(tl.reshape(products, [BLOCK_N, BLOCKS, SCALE_K]), 2)
        blocks = k // SCALE_K + tl.arange(0, BLOCKS)
        scales = tl.load(s_rows[:, None] + blocks[None, :], mask=(blocks < KB)[None, :], other=0.0)
        products = sums * scales
    return products
