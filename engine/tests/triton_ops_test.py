"""Tests of engine.triton_ops against the eager ops of engine.model.

Runs like triton_attention_test: through Triton's CPU interpreter without CUDA
(`//engine:triton_ops_test`), compiled on a GPU otherwise (`//engine:triton_ops_gpu_test`, tag
`gpu`), where the tests marked `cuda` run too:
    python -m pytest -q engine/tests/triton_ops_test.py
"""

import pytest
import torch

from engine.tests import triton_mode  # before triton: picks the interpreter on CPU

# isort: split
from engine import model, triton_ops

KERNEL = triton_ops._rms_norm_kernel
DEVICE = triton_mode.device_of(KERNEL)
INTERPRETED = triton_mode.interpreted(KERNEL)
# Relative to the output's norm: fp32 differs by reduction order only; bf16 by an output ulp
# here and there (the kernels keep fp32 where eager rounds an intermediate: RoPE).
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)
cuda = pytest.mark.cuda  # needs compiled kernels on a GPU


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    if error := triton_mode.mode_error(KERNEL):
        pytest.fail(error)


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _close(ours, eager, dtype):
    assert ours.shape == eager.shape and ours.dtype == eager.dtype
    assert not ours.isnan().any()
    error = (ours.double() - eager.double()).norm() / eager.double().norm()
    assert error < TOLERANCE[dtype], error.item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (5, 576), (3, 4, 64)], ids=str)
def test_rms_norm_matches_eager(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=1)
    weight = _randn(shape[-1], dtype=dtype, seed=2)
    _close(triton_ops.rms_norm(x, weight, 1e-5), model.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_eager(dtype):
    x, residual = _randn(7, 576, dtype=dtype, seed=3), _randn(7, 576, dtype=dtype, seed=4)
    weight = _randn(576, dtype=dtype, seed=5)
    normed, summed = triton_ops.add_rms_norm(x, residual, weight, 1e-6)
    eager_normed, eager_summed = model.add_rms_norm(x, residual, weight, 1e-6)
    _close(normed, eager_normed, dtype)
    _close(summed, eager_summed, dtype)


@cuda
def test_residual_sum_is_bit_exact_on_gpu():
    """The residual stream must not drift from the eager path's: one rounded add, the same."""
    x, residual = (_randn(9, 4096, dtype=torch.bfloat16, seed=s) for s in (6, 7))
    weight = _randn(4096, dtype=torch.bfloat16, seed=8)
    _, summed = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading", [(1,), (3,), (2, 5)], ids=str)
def test_silu_and_mul_matches_eager(dtype, leading):
    gate_up = _randn(*leading, 2 * 1500, dtype=dtype, seed=9)  # 1500: a ragged column block
    _close(triton_ops.silu_and_mul(gate_up), model.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (6, 2, 64), (3, 3, 48)])
def test_rope_on_qkv_views_matches_eager(dtype, heads, kv_heads, head_dim):
    """q and k as the model passes them: strided views of one qkv row per token."""
    tokens = 5
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=10)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = _randn(tokens, head_dim // 2, dtype=torch.float32, seed=11) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ours, eager = triton_ops.rope(q, k, cos, sin), model.rope(q, k, cos, sin)
    for a, b in zip(ours, eager, strict=True):
        _close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rope_on_mla_views_matches_eager(dtype):
    """MLA's q_pe (the last 64 of each head's 192 channels) and k_pe (the last 64 of the latent
    projection's 576), RoPE pairs adjacent: out de-interleaved, as the eager rope."""
    tokens, heads = 3, 4
    q = _randn(tokens, heads, 192, dtype=dtype, seed=13)[..., 128:]
    k = _randn(tokens, 576, dtype=dtype, seed=14)[:, 512:][:, None]
    angles = _randn(tokens, 32, dtype=torch.float32, seed=15) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    ours = triton_ops.rope(q, k, cos, sin, interleaved=True)
    eager = model.rope(q, k, cos, sin, interleaved=True)
    for a, b in zip(ours, eager, strict=True):
        _close(a, b, dtype)
    # Channel 0 pairs with channel 1 (not 32): the rotation of (x0, x1) by the first angle.
    x0, x1 = q[..., 0].float(), q[..., 1].float()
    c, s_ = cos[:, None, 0].float(), sin[:, None, 0].float()
    _close(ours[0][..., 0], (x0 * c - x1 * s_).to(dtype), dtype)
    _close(ours[0][..., 32], (x1 * c + x0 * s_).to(dtype), dtype)


def test_empty_inputs_launch_nothing():
    x = _randn(0, 64, dtype=torch.float32, seed=12)
    weight = _randn(64, dtype=torch.float32, seed=13)
    assert triton_ops.rms_norm(x, weight, 1e-5).shape == (0, 64)
    assert triton_ops.silu_and_mul(_randn(0, 128, dtype=torch.float32, seed=14)).shape == (0, 64)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (3, 5000), (2, 4096), (4, 17)])
def test_greedy_tokens_equal_torch_argmax(rows, vocab):
    logits = _randn(rows, vocab, dtype=torch.float32, seed=15)
    assert torch.equal(triton_ops.greedy_tokens(logits), logits.argmax(dim=-1))


def test_greedy_tokens_take_the_first_of_tied_maxima_across_chunks():
    logits = _randn(1, 10_000, dtype=torch.float32, seed=16)
    top = logits.max() + 1
    logits[0, 9_000] = top  # in the third 4096-token chunk
    logits[0, 4_100] = top  # the same value, earlier, in the second
    assert triton_ops.greedy_tokens(logits).tolist() == [4_100]
