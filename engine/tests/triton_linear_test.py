"""Tests of engine.triton_linear (the decode GEMV) against a float64 reference.

Runs like triton_attention_test: through Triton's CPU interpreter without CUDA
(`//engine:triton_linear_test`), compiled on a GPU otherwise, where the tests marked `cuda` run
too (`//engine:triton_linear_gpu_test`, tag `gpu`):
    python -m pytest -q engine/tests/triton_linear_test.py
"""

import pytest
import torch
import torch.nn.functional as F

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split
from engine import triton_linear

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
        (6144, 4096, torch.bfloat16, False),  # tall: 8 rows a program (qkv_proj's shape)
        (301, 64, torch.float32, True),  # tall, one short K step, a ragged last program
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


@cuda
def test_dependent_chain_in_cuda_graph_matches_eager():
    """Each product reads the one before: with programmatic dependent launch inside a captured
    graph, a kernel that read its input before the previous one finished would differ."""
    gen = torch.Generator().manual_seed(2)
    weights = [
        (torch.randn(4096, 4096, generator=gen) / 64).to(torch.bfloat16).cuda() for _ in range(8)
    ]
    x = torch.randn(1, 4096, generator=gen).to(torch.bfloat16).cuda()

    def chain(v):
        for w in weights:
            v = triton_linear.linear(v, w)
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
