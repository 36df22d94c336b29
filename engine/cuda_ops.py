"""The model's ops on CUDA: a Triton kernel for each elementwise chain (engine.triton_ops) and
the one-row GEMV for linear layers (engine.triton_linear). Attention is the backend's."""

from engine import triton_linear, triton_ops
from engine.model import ModelOps

CUDA_OPS = ModelOps(
    rms_norm=triton_ops.rms_norm,
    add_rms_norm=triton_ops.add_rms_norm,
    silu_and_mul=triton_ops.silu_and_mul,
    rope=triton_ops.rope,
    linear=triton_linear.linear,
)
