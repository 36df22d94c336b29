"""The model's ops on CUDA: a Triton kernel for each elementwise chain (engine.triton_ops) and
the one-row GEMV or the few-row kernel for linear layers (engine.triton_linear). Where those
apply they also do the op before or after a projection:
- the residual add after o_proj and down_proj, storing the sum times the next norm's weight too
  (`add_linear`);
- with that, the RMSNorm before qkv_proj, gate_up_proj and MLA's fused_qkv_a_proj
  (`triton_linear.Prenorm`);
- RoPE after qkv_proj and SwiGLU after gate_up_proj.
Attention is the backend's."""

from collections.abc import Callable

import torch

from engine import triton_linear, triton_ops
from engine.fp8 import Matrix
from engine.model import ModelOps, NormInput, split_heads


def qkv_rope(
    inp: NormInput,
    weight: Matrix,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)

    def fuses(x: torch.Tensor) -> bool:
        return triton_linear.fuses_rope(x, weight, head_dim)

    x, norm, summed = _gemv_input(inp, fuses)
    if fuses(x):
        rotated = (num_heads + num_kv_heads) * head_dim
        qkv = triton_linear.linear_rope(x, weight, bias, cos, sin, head_dim, rotated, norm)
        return (*split_heads(qkv, num_heads, num_kv_heads), summed)
    q, k, v = split_heads(triton_linear.linear(x, weight, bias), num_heads, num_kv_heads)
    return (*triton_ops.rope(q, k, cos, sin), v, summed)


def gate_up_silu(inp: NormInput, weight: Matrix) -> tuple[torch.Tensor, torch.Tensor]:
    def fuses(x: torch.Tensor) -> bool:
        return triton_linear.fuses_silu(x, weight)

    x, norm, summed = _gemv_input(inp, fuses)
    if fuses(x):
        return triton_linear.linear_silu(x, weight, norm), summed
    return triton_ops.silu_and_mul(triton_linear.linear(x, weight)), summed


def norm_linear(
    inp: NormInput, weight: Matrix, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    x, norm, summed = _gemv_input(inp, lambda x: triton_linear.fuses(x, weight))
    return triton_linear.linear(x, weight, bias, norm), summed


def add_linear(
    x: torch.Tensor,
    weight: Matrix,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> NormInput:
    if triton_linear.fuses(x, weight) and residual.is_contiguous():
        h, scaled = triton_linear.linear_residual(x, weight, residual, norm_weight)
        return NormInput(h, None, norm_weight, eps, scaled)
    return NormInput(triton_linear.linear(x, weight), residual, norm_weight, eps)


def _gemv_input(
    inp: NormInput, fuses: Callable[[torch.Tensor], bool]
) -> tuple[torch.Tensor, triton_linear.Prenorm | None, torch.Tensor]:
    """(the projection's input, the norm the GEMV still has to apply, x + residual): the
    scaled input and a Prenorm where the op before stored one and the fused GEMV applies to
    it, else the output of the norm's own kernel."""
    if inp.scaled is not None and fuses(inp.scaled):
        return inp.scaled, triton_linear.Prenorm(inp.x, inp.eps), inp.x
    h, summed = inp.compute(CUDA_OPS)
    return h, None, summed


CUDA_OPS = ModelOps(
    rms_norm=triton_ops.rms_norm,
    add_rms_norm=triton_ops.add_rms_norm,
    rope=triton_ops.rope,
    linear=triton_linear.linear,
    qkv_rope=qkv_rope,
    gate_up_silu=gate_up_silu,
    add_linear=add_linear,
    norm_linear=norm_linear,
)
