"""Tests of engine.triton_gemv_rows (products of 2 to 64 rows) against a float64 reference.

Runs like triton_linear_test (which also runs this kernel in a captured chain on a GPU):
through Triton's CPU interpreter without CUDA (`//engine:triton_gemv_rows_test`), compiled on a
GPU otherwise (`//engine:triton_gemv_rows_gpu_test`, tag `gpu`):
    python -m pytest -q engine/tests/triton_gemv_rows_test.py
"""

import pytest
import torch
import torch.nn.functional as F

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split
from engine import triton_gemv_rows, triton_linear

KERNEL = triton_gemv_rows._rows_kernel
DEVICE = triton_mode.device_of(KERNEL)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    if error := triton_mode.mode_error(KERNEL):
        pytest.fail(error)


def _case(rows, out_features, in_features, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    return x.to(DEVICE), weight.to(DEVICE), None if b is None else b.to(DEVICE), ref


def _relative_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's: a row computed from another row's input, or not at all, fails alone."""
    return (out.double().cpu() - ref).norm(dim=1) / ref.norm(dim=1)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "dtype", "bias"),
    [
        (4, 64, 1024, torch.bfloat16, False),  # whole K steps
        (2, 37, 576, torch.float16, True),  # ragged K (SmolLM2's width) and N % BLOCK_N != 0
        (16, 48, 64, torch.bfloat16, True),  # K shorter than one step
        (33, 40, 200, torch.bfloat16, False),  # rows padded to 64; K not a multiple of 16
        (64, 16, 128, torch.float16, True),  # the most rows
        (5, 300, 256, torch.bfloat16, False),  # tall, a ragged last program
    ],
)
def test_rows_match_float64_reference(rows, out_features, in_features, dtype, bias, monkeypatch):
    monkeypatch.setattr(triton_linear, "ROWS_KERNEL_MAX_ROWS", triton_gemv_rows.MAX_ROWS)
    monkeypatch.setattr(triton_linear, "ROWS_KERNEL_VERY_TALL", True)
    x, weight, b, ref = _case(rows, out_features, in_features, dtype, bias)
    assert triton_gemv_rows.applies(x, weight)
    y = triton_linear.linear(x, weight, b)  # the engine's entry: it picks this kernel
    assert y.shape == (rows, out_features) and y.dtype == dtype
    assert (_relative_errors(y, ref) < TOLERANCE[dtype]).all()


def test_rows_of_a_strided_input():
    """A verification's rows can be a view of a wider buffer: each row read at its stride."""
    x, weight, _, _ = _case(3, 32, 128, torch.bfloat16, False, seed=1)
    wide = torch.zeros(3, 256, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 64:192] = x
    view = wide[:, 64:192]
    assert view.stride(0) == 256
    ref = F.linear(x.double(), weight.double()).cpu()
    assert (_relative_errors(triton_gemv_rows.launch(view, weight, None), ref) < 1e-2).all()


@pytest.mark.parametrize(
    ("rows", "in_features", "dtype"),
    [(1, 128, torch.bfloat16), (65, 128, torch.bfloat16), (4, 128, torch.float32), (4, 8, None)],
    ids=["one_row", "too_many_rows", "float32", "k_shorter_than_a_dot_step"],
)
def test_other_inputs_are_not_taken(rows, in_features, dtype):
    weight = torch.randn(16, in_features).to(dtype or torch.bfloat16).to(DEVICE)
    x = torch.randn(rows, in_features).to(weight.dtype).to(DEVICE)
    assert not triton_gemv_rows.applies(x, weight)
    assert not triton_gemv_rows.applies(x.float(), weight)  # mismatched dtypes neither


def test_the_engine_takes_the_kernel_for_a_few_rows_of_matrices_not_very_tall():
    """Where it streams faster than cuBLAS (triton_linear.ROWS_KERNEL_MAX_ROWS): 2 to 4 rows of
    qkv-, o_proj- and down-like matrices; more rows, and very tall matrices (gate_up, lm_head),
    stay F.linear."""
    x, weight, _, ref = _case(4, 32, 128, torch.bfloat16, False, seed=3)
    assert triton_linear.fuses(x, weight)
    assert (
        _relative_errors(triton_linear.linear(x, weight), ref) < TOLERANCE[torch.bfloat16]
    ).all()
    more, _, _, _ = _case(5, 32, 128, torch.bfloat16, False, seed=3)
    tall, tall_weight, _, _ = _case(4, 3 * 128, 128, torch.bfloat16, False, seed=3)
    for rows, matrix in ((more, weight), (tall, tall_weight)):
        assert not triton_linear.fuses(rows, matrix)
        assert torch.equal(triton_linear.linear(rows, matrix), F.linear(rows, matrix))
