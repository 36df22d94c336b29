"""Tests of engine.triton_linear (the decode GEMV) against a float64 reference.

Runs like triton_attention_test: through Triton's CPU interpreter without CUDA
(`//engine:triton_linear_test`), compiled on a GPU otherwise, where the tests marked `cuda` run
too (`//engine:triton_linear_gpu_test`, tag `gpu`):
    python -m pytest -q engine/tests/triton_linear_test.py
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split
from engine import cuda_ops, model, triton_gemv_rows, triton_linear, triton_ops

KERNEL = triton_linear._gemv_kernel
DEVICE = triton_mode.device_of(KERNEL)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
cuda = pytest.mark.cuda  # needs compiled kernels on a GPU


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    if error := triton_mode.mode_error(KERNEL):
        pytest.fail(error)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _case(out_features, in_features, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(1, in_features, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(out_features, generator=gen).to(dtype).to(DEVICE) if bias else None
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    return x, weight, b, ref


@pytest.mark.parametrize(
    ("out_features", "in_features", "dtype", "bias"),
    [
        (64, 4096, torch.bfloat16, False),  # whole BLOCK_K steps (K % 2048 == 0)
        (37, 576, torch.float32, True),  # ragged K (SmolLM2's width) and N % BLOCK_N != 0
        (6, 2048 + 64, torch.float16, True),  # one whole step, then a masked one
        (1, 8, torch.bfloat16, False),  # fewer rows than one program owns
        (6144, 4096, torch.bfloat16, False),  # tall: 16 rows a program (qkv_proj's shape)
        (250, 128, torch.float32, True),  # tall, one K step, a ragged last program
        (301, 64, torch.float32, True),  # very tall: 8 rows, one short K step, ragged
    ],
)
def test_one_row_matches_float64_reference(out_features, in_features, dtype, bias):
    x, weight, b, ref = _case(out_features, in_features, dtype, bias)
    y = triton_linear.linear(x, weight, b)
    assert y.shape == (1, out_features) and y.dtype == dtype
    assert _relative_error(y, ref) < TOLERANCE[dtype]


def test_every_row_is_written():
    """Fresh inputs each call: a row left unwritten would hold whatever torch.empty gave."""
    for seed in range(3):
        x, weight, _, ref = _case(9, 256, torch.float32, False, seed=seed)
        y = triton_linear.linear(x, weight)
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape",
    [(3, 128), (128,), (1, 1, 128)],
    ids=["three_rows", "one_dim", "three_dim"],
)
def test_other_shapes_are_exactly_f_linear(x_shape):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 128, generator=gen).to(DEVICE)
    x = torch.randn(x_shape, generator=gen).to(DEVICE)
    assert torch.equal(triton_linear.linear(x, weight), F.linear(x, weight))


def test_mismatched_dtype_is_f_linear():
    weight = torch.randn(16, 128).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(1, 128).to(DEVICE)
    with pytest.raises(RuntimeError, match="dtype"):  # F.linear's own error, not a wrong result
        triton_linear.linear(x, weight)


@pytest.mark.parametrize(
    ("intermediate", "hidden", "dtype"),
    [(128, 4096, torch.bfloat16), (48, 576, torch.float32), (1536, 64, torch.bfloat16)],
)
def test_silu_epilogue_equals_the_separate_kernels(intermediate, hidden, dtype):
    """Same products in the same order, then SwiGLU on the rounded outputs: bit for bit what
    silu_and_mul does to the plain GEMV's output, and close to eager float64."""
    x, weight, _, ref = _case(2 * intermediate, hidden, dtype, False, seed=3)
    assert triton_linear.fuses_silu(x, weight)
    fused = triton_linear.linear_silu(x, weight)
    assert fused.shape == (1, intermediate) and fused.dtype == dtype
    assert torch.equal(fused, triton_ops.silu_and_mul(triton_linear.linear(x, weight)))
    # Rounded three times (product, silu, silu * up) where the reference is not.
    assert _relative_error(fused, model.silu_and_mul(ref)) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "hidden", "dtype", "bias"),
    [
        (32, 8, 128, 4096, torch.bfloat16, False),  # Llama-3-8B's qkv_proj
        (9, 3, 64, 576, torch.float32, True),  # SmolLM2-135M's, with a bias as Qwen2 has
        (4, 2, 16, 256, torch.bfloat16, True),  # 2 rows a program: one pair of a head
    ],
)
def test_rope_epilogue_equals_the_separate_kernels(heads, kv_heads, head_dim, hidden, dtype, bias):
    out_features = (heads + 2 * kv_heads) * head_dim
    x, weight, b, ref = _case(out_features, hidden, dtype, bias, seed=4)
    cos, sin = _angles(head_dim, dtype)
    assert triton_linear.fuses_rope(x, weight, head_dim)
    rotated = (heads + kv_heads) * head_dim
    qkv = triton_linear.linear_rope(x, weight, b, cos, sin, head_dim, rotated)
    q, k, v = model.split_heads(qkv, heads, kv_heads)
    plain_q, plain_k, plain_v = model.split_heads(
        triton_linear.linear(x, weight, b), heads, kv_heads
    )
    rotated_q, rotated_k = triton_ops.rope(plain_q, plain_k, cos, sin)
    # Bit for bit where the projection is rounded before RoPE; in fp32 the compiler may fuse a
    # multiply of the rotation with the bias add into an FMA in one kernel and not the other.
    same = torch.equal if dtype != torch.float32 else _within_a_few_ulps
    assert same(q, rotated_q) and same(k, rotated_k)
    assert same(v, plain_v)  # v is not rotated
    ref_q, ref_k, ref_v = model.split_heads(ref, heads, kv_heads)
    eager = (*model.rope(ref_q, ref_k, cos.double(), sin.double()), ref_v)
    for ours, expected in zip((q, k, v), eager, strict=True):
        assert _relative_error(ours, expected) < 2 * TOLERANCE[dtype]  # rounded twice


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "hidden", "dtype", "rows"),
    [
        (16, 4, 64, 1024, torch.bfloat16, 1),  # tall qkv: 16 rows a program, two K steps
        (9, 3, 64, 576, torch.float32, 1),  # SmolLM2-135M: K is not a power of two
        (4, 2, 16, 96, torch.float16, 1),  # one short, masked K step
        (16, 4, 64, 1024, torch.bfloat16, 4),  # a verification's rows: the few-row kernel
        (9, 3, 64, 576, torch.float16, 3),  # ... K not a power of two
    ],
)
def test_residual_add_and_norm_in_the_gemvs(
    heads, kv_heads, head_dim, hidden, dtype, rows, monkeypatch
):
    """o_proj's GEMV (or few-row kernel) adds the residual and stores the sum times the next
    norm's weight; qkv_proj's, gate_up_proj's and a plain projection's (MLA's
    fused_qkv_a_proj) then apply the norm, each row with its own mean square and RoPE angles.
    The sum is bit for bit the separate add's; the products are close to float64, and no
    further from it than those of the norm's own kernel followed by the same kernels (the fused
    path does not round the normalized input)."""
    monkeypatch.setattr(triton_linear, "ROWS_KERNEL_MAX_ROWS", triton_gemv_rows.MAX_ROWS)
    monkeypatch.setattr(triton_linear, "ROWS_KERNEL_VERY_TALL", True)
    gen = torch.Generator().manual_seed(8)
    o_w = _weight(gen, hidden, heads * head_dim, dtype)
    qkv_w = _weight(gen, (heads + 2 * kv_heads) * head_dim, hidden, dtype)
    gate_up_w = _weight(gen, 2 * 256, hidden, dtype)  # short: the interpreter is slow
    attn = torch.randn(rows, heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    residual[-1] *= 4  # rows of different mean squares
    norm_w = (1 + torch.rand(hidden, generator=gen)).to(dtype).to(DEVICE)
    cos, sin = _angles(head_dim, dtype, rows)
    plain_w = _weight(gen, 3 * head_dim, hidden, dtype)

    inp = cuda_ops.add_linear(attn, o_w, residual, norm_w, 1e-5)
    # The norm's kernel stores the sum as it would be without the fusion.
    h, expected_sum = triton_ops.add_rms_norm(
        triton_linear.linear(attn, o_w), residual, norm_w, 1e-5
    )
    assert inp.residual is None and torch.equal(inp.x, expected_sum)
    one_rounding = torch.finfo(dtype).eps  # the interpreter truncates where CUDA rounds
    expected_scaled = expected_sum.float() * norm_w.float()
    assert torch.allclose(inp.scaled.float(), expected_scaled, rtol=one_rounding, atol=0)
    *qkv, summed = cuda_ops.qkv_rope(inp, qkv_w, None, cos, sin, heads, kv_heads)
    act, mlp_summed = cuda_ops.gate_up_silu(inp, gate_up_w)
    projected, plain_summed = cuda_ops.norm_linear(inp, plain_w, None)
    assert summed is inp.x and mlp_summed is inp.x and plain_summed is inp.x

    rotated = (heads + kv_heads) * head_dim
    separate_qkv = model.split_heads(
        triton_linear.linear_rope(h, qkv_w, None, cos, sin, head_dim, rotated), heads, kv_heads
    )
    separate = (*separate_qkv, triton_linear.linear_silu(h, gate_up_w))
    separate += (triton_linear.linear(h, plain_w),)
    h64 = model.rms_norm(expected_sum.double(), norm_w.double(), 1e-5)
    q64, k64, v64 = model.split_heads(F.linear(h64, qkv_w.double()), heads, kv_heads)
    exact = (*model.rope(q64, k64, cos.double(), sin.double()), v64)
    exact += (
        model.silu_and_mul(F.linear(h64, gate_up_w.double())),
        F.linear(h64, plain_w.double()),
    )
    for ours, theirs, ref in zip((*qkv, act, projected), separate, exact, strict=True):
        error = _relative_error(ours, ref)
        assert error < 2 * TOLERANCE[dtype]  # rounded twice
        assert error < 1.5 * _relative_error(theirs, ref)  # no worse than the separate kernels


def test_norm_input_without_a_scaled_vector_runs_the_norm_kernel():
    """The first layer's input (the embedding) comes with no scaled vector: the norm's own
    kernel, then the fused GEMVs, exactly as computed apart."""
    x, weight, _, _ = _case(2 * 96, 64, torch.float32, False, seed=9)
    norm_w = torch.rand(64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    act, summed = cuda_ops.gate_up_silu(model.NormInput(x, None, norm_w, 1e-6), weight)
    assert summed is x
    expected = triton_linear.linear_silu(triton_ops.rms_norm(x, norm_w, 1e-6), weight)
    assert torch.equal(act, expected)


def test_epilogues_of_several_rows_are_the_separate_ops():
    """A prefill or batched decode step: the norm's kernel, cuBLAS, then the elementwise
    kernel, as the eager ops."""
    x, weight, b, _ = _case(3 * 4 * 16, 64, torch.float32, True, seed=6)
    x = torch.cat([x, x * 2, -x])
    angles = torch.rand(3, 8, generator=torch.Generator().manual_seed(7))
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    norm_w = torch.rand(64).to(DEVICE)
    inp = cuda_ops.add_linear(x, weight[:64], x.flip(0), norm_w, 1e-6)
    assert torch.allclose(inp.x, F.linear(x, weight[:64]), rtol=1e-5, atol=1e-5)
    assert inp.residual is not None and inp.scaled is None  # the add is left to the norm
    assert not triton_linear.fuses_rope(x, weight, 16)
    assert not triton_linear.fuses_silu(x, weight)
    fused = cuda_ops.qkv_rope(inp, weight, b, cos, sin, 4, 4)
    eager = model.qkv_rope(inp, weight, b, cos, sin, 4, 4)
    for ours, theirs in zip(fused, eager, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(
        cuda_ops.gate_up_silu(inp, weight), model.gate_up_silu(inp, weight), strict=True
    ):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def _weight(gen, out_features, in_features, dtype):
    return (
        (torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
        .to(dtype)
        .to(DEVICE)
    )


def _angles(head_dim, dtype, rows=1):
    angles = torch.rand(rows, head_dim // 2, generator=torch.Generator().manual_seed(5)) * 100
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


def _within_a_few_ulps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp32 values equal to a few ulps of the largest (a rotation can cancel to near 0)."""
    return torch.allclose(a, b, rtol=0, atol=4 * torch.finfo(a.dtype).eps * b.abs().max().item())


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


@cuda
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_dependent_chain_in_cuda_graph_matches_eager(rows):
    """Each product reads the one before: with programmatic dependent launch inside a captured
    graph, a kernel that read its input before the previous one finished would differ. One row
    runs the GEMV, more the few-row kernel."""
    gen = torch.Generator().manual_seed(2)
    weights = [
        (torch.randn(4096, 4096, generator=gen) / 64).to(torch.bfloat16).cuda() for _ in range(8)
    ]
    x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).cuda()
    product = triton_linear.linear if rows == 1 else partial(triton_gemv_rows.launch, bias=None)

    def chain(v):
        for w in weights:
            v = product(v, w)
        return v

    expected = chain(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
