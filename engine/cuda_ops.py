"""The model's ops on CUDA: a Triton kernel for each elementwise chain (engine.triton_ops) and
the one-row GEMV for linear layers (engine.triton_linear), which also computes RoPE after
qkv_proj and SwiGLU after gate_up_proj where it applies. Attention is the backend's."""

import torch

from engine import triton_linear, triton_ops
from engine.model import ModelOps, split_heads


def qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    if triton_linear.fuses_rope(x, weight, head_dim):
        rotated = (num_heads + num_kv_heads) * head_dim
        qkv = triton_linear.linear_rope(x, weight, bias, cos, sin, head_dim, rotated)
        return split_heads(qkv, num_heads, num_kv_heads)
    q, k, v = split_heads(triton_linear.linear(x, weight, bias), num_heads, num_kv_heads)
    return (*triton_ops.rope(q, k, cos, sin), v)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if triton_linear.fuses_silu(x, weight):
        return triton_linear.linear_silu(x, weight)
    return triton_ops.silu_and_mul(triton_linear.linear(x, weight))


CUDA_OPS = ModelOps(
    rms_norm=triton_ops.rms_norm,
    add_rms_norm=triton_ops.add_rms_norm,
    rope=triton_ops.rope,
    linear=triton_linear.linear,
    qkv_rope=qkv_rope,
    gate_up_silu=gate_up_silu,
)
