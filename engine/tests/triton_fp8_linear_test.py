"""Tests of the fp8 matrix products (engine.triton_linear's GEMV on an Fp8Weight, and
engine.triton_fp8_gemm) against float64 products of the dequantized matrix.

Runs like triton_linear_test: through Triton's CPU interpreter without CUDA
(`//engine:triton_fp8_linear_test`), compiled on a GPU otherwise, where the tests marked `cuda`
run too (`//engine:triton_fp8_linear_gpu_test`, tag `gpu`):
    python -m pytest -q engine/tests/triton_fp8_linear_test.py
"""

import pytest
import torch
import torch.nn.functional as F

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split
from engine import cuda_ops, model, triton_fp8_gemm, triton_linear, triton_ops
from engine.fp8 import FP8_DTYPE, Fp8Scheme, Fp8Weight, quantize

DEVICE = triton_mode.device_of(triton_linear._gemv_kernel)
# Relative error against float64 of the dequantized matrix: the output's rounding only.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
cuda = pytest.mark.cuda  # needs compiled kernels on a GPU


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    with triton_mode.runnable(triton_linear._gemv_kernel):
        yield


def _matrix(out_features, in_features, block, seed=0) -> Fp8Weight:
    """A random matrix quantized with scale blocks block x block (None: per tensor)."""
    gen = torch.Generator().manual_seed(seed)
    scheme = Fp8Scheme(block, block)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    values, scale = quantize(weight, scheme)
    rows = scheme.expand_scale(scale, out_features).contiguous()
    return scheme.matrix(values.to(DEVICE), rows.to(DEVICE))


def _inputs(rows, in_features, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=gen).to(dtype).to(DEVICE)


def _reference(x, matrix: Fp8Weight, bias=None):
    """The float64 product of the dequantized matrix with x, or with x as the kernel quantizes
    it (e4m3 per 128 columns of a row) where it does."""
    dense = matrix.dense(torch.float64)
    if triton_fp8_gemm.quantizes_activations(x, matrix):
        x = _quantized(x.cpu().float()).to(DEVICE)
    return F.linear(x.double(), dense, None if bias is None else bias.double())


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] through e4m3 and back, each row's 128-column group scaled so that its largest
    magnitude maps to 448."""
    rows, columns = x.shape
    groups = torch.zeros(rows, -(-columns // 128) * 128).index_copy_(1, torch.arange(columns), x)
    groups = groups.view(rows, -1, 128)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((groups / scale).to(FP8_DTYPE).float() * scale).view(rows, -1)[:, :columns]


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    ("out_features", "in_features", "block", "dtype", "bias"),
    [
        (64, 4096, 128, torch.bfloat16, False),  # several K steps of several scale blocks
        (200, 1024, 128, torch.float32, True),  # ragged last program
        (96, 576, 32, torch.float32, False),  # ragged K (a masked step), small blocks
        (37, 576, None, torch.float32, True),  # a scale per tensor: applied at the end
        (512, 64, 64, torch.bfloat16, False),  # very tall: one K step of one block
    ],
)
def test_one_row_gemv_matches_the_dequantized_product(
    out_features, in_features, block, dtype, bias
):
    matrix = _matrix(out_features, in_features, block)
    x = _inputs(1, in_features, dtype)
    b = _inputs(1, out_features, dtype, seed=2)[0] if bias else None
    assert triton_linear.gemv_applies(x, matrix)
    y = triton_linear.linear(x, matrix, b)
    assert y.shape == (1, out_features) and y.dtype == dtype
    assert _relative_error(y, _reference(x, matrix, b)) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "block", "dtype"),
    [
        (2, 96, 256, 128, torch.float32),  # a decode batch: one row tile, x quantized
        (17, 200, 1024, 128, torch.bfloat16),  # ragged rows and columns
        (70, 64, 192, 48, torch.float32),  # a prefill chunk; 48-column blocks: 16-column steps
        (5, 40, 100, None, torch.float32),  # per tensor, K short of one quantization group
        (1, 64, 96, 48, torch.float32),  # one row whose blocks the GEMV cannot step by
        (256, 72, 256, 128, torch.float32),  # a prefill chunk: W dequantized, then cuBLAS
        (300, 40, 100, None, torch.float32),  # the same, per tensor, ragged
    ],
)
def test_gemm_matches_the_dequantized_product(rows, out_features, in_features, block, dtype):
    matrix = _matrix(out_features, in_features, block, seed=rows)
    x = _inputs(rows, in_features, dtype)
    b = _inputs(1, out_features, dtype, seed=3)[0]
    assert triton_fp8_gemm.applies(x, matrix) and not triton_linear.gemv_applies(x, matrix)
    y = triton_linear.linear(x, matrix, b)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    assert triton_fp8_gemm.quantizes_activations(x, matrix) == (1 < rows < 128 and block != 48)
    assert _relative_error(y, _reference(x, matrix, b)) < TOLERANCE[dtype]


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_k_equals_one_pass(splits):
    """K split among programs (as small batches on a GPU are), partials summed in a fixed
    order: the product of the dequantized matrix, with the bias added once."""
    matrix = _matrix(80, 1024, 128, seed=4)  # 8 K steps of 128: 3 splits of 3, 3 and 2
    x = _inputs(6, 1024, torch.float32)
    b = _inputs(1, 80, torch.float32, seed=3)[0]
    y = triton_fp8_gemm.linear(x, matrix, b, splits=splits)
    assert _relative_error(y, _reference(x, matrix, b)) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="splits must be in"):
        triton_fp8_gemm.linear(x, matrix, b, splits=9)


def test_choose_splits_fills_two_waves_of_steps_of_four():
    assert triton_fp8_gemm.choose_splits(tiles=64, k_steps=32, sm_count=132) == 5
    assert triton_fp8_gemm.choose_splits(tiles=64, k_steps=8, sm_count=132) == 2
    assert triton_fp8_gemm.choose_splits(tiles=448, k_steps=32, sm_count=132) == 1


def test_blocks_no_kernel_can_step_by_take_the_dense_matrix():
    """40-column blocks: no power-of-two step of at least 16 divides them."""
    matrix = _matrix(48, 120, 40)
    x = _inputs(3, 120, torch.float32)
    assert not triton_fp8_gemm.applies(x, matrix)
    torch.testing.assert_close(triton_linear.linear(x, matrix), F.linear(x, matrix.dense(x.dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_epilogues_on_fp8_equal_the_separate_kernels(dtype):
    """SwiGLU, RoPE, and the residual add with the next norm, in the fp8 GEMV's epilogue: bit
    for bit the separate kernels on its plain output, as for bf16 weights."""
    heads, kv_heads, head_dim, hidden = 4, 2, 32, 256
    gen = torch.Generator().manual_seed(6)
    qkv = _matrix((heads + 2 * kv_heads) * head_dim, hidden, 128, seed=7)
    gate_up, o = _matrix(2 * 128, hidden, 128, seed=8), _matrix(hidden, heads * head_dim, 64)
    x = _inputs(1, hidden, dtype)
    angles = torch.rand(1, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)

    assert triton_linear.fuses_silu(x, gate_up)
    silu = triton_ops.silu_and_mul(triton_linear.linear(x, gate_up))
    assert torch.equal(triton_linear.linear_silu(x, gate_up), silu)

    assert triton_linear.fuses_rope(x, qkv, head_dim)
    rotated = (heads + kv_heads) * head_dim
    fused = model.split_heads(
        triton_linear.linear_rope(x, qkv, None, cos, sin, head_dim, rotated), heads, kv_heads
    )
    q, k, v = model.split_heads(triton_linear.linear(x, qkv), heads, kv_heads)
    separate = (*triton_ops.rope(q, k, cos, sin), v)
    for ours, theirs in zip(fused, separate, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=4 * torch.finfo(dtype).eps)

    attn = _inputs(1, heads * head_dim, dtype, seed=4)
    residual, norm_w = _inputs(1, hidden, dtype, seed=5), _inputs(1, hidden, dtype, seed=6)[0]
    inp = cuda_ops.add_linear(attn, o, residual, norm_w, 1e-5)
    _, expected_sum = triton_ops.add_rms_norm(triton_linear.linear(attn, o), residual, norm_w, 1e-5)
    assert inp.residual is None and torch.equal(inp.x, expected_sum)


@cuda
def test_llama3_8b_shapes_in_a_cuda_graph():
    """Llama-3-8B's projections at bs 1 (GEMV) and 8 (GEMM), 128x128 blocks, captured once and
    replayed: equal to eager, and close to the dequantized product."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    matrices = [_matrix(n, k, 128, seed=i) for i, (n, k) in enumerate(shapes)]
    inputs = {rows: {k: _inputs(rows, k, torch.bfloat16) for _, k in shapes} for rows in (1, 8)}

    def products():
        return [
            triton_linear.linear(inputs[rows][m.weight.shape[1]], m)
            for rows in (1, 8)
            for m in matrices
        ]

    eager = products()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = products()
    graph.replay()
    torch.cuda.synchronize()
    for ours, theirs in zip(captured, eager, strict=True):
        assert torch.equal(ours, theirs)
    for (rows, m), y in zip([(r, m) for r in (1, 8) for m in matrices], eager, strict=True):
        ref = _reference(inputs[rows][m.weight.shape[1]], m)
        assert _relative_error(y, ref) < TOLERANCE[torch.bfloat16]
