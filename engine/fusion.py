"""Fused elementwise ops for CUDA: the model's PointwiseOps, each compiled by torch.compile.

Unfused, a decode step of an 8B model runs ~25 tiny elementwise kernels per layer (RMSNorm
alone is six), ~800 in all at ~2.5 us each: more than half the time the weights take to
stream. Compiled, each op is one Triton kernel. GEMMs and attention stay as they are.
`dynamic=True`: one compilation serves every token count (T=1 gets its own, as torch.compile
specializes size-1 dimensions).
"""

from __future__ import annotations

import functools

import torch

from engine.model import EAGER_OPS, PointwiseOps


@functools.cache
def compiled_ops() -> PointwiseOps:
    """Compiled once per process and shared by every model (torch.compile caches per function)."""
    compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    return PointwiseOps(
        rms_norm=compile_(EAGER_OPS.rms_norm),
        add_rms_norm=compile_(EAGER_OPS.add_rms_norm),
        silu_and_mul=compile_(EAGER_OPS.silu_and_mul),
        rope=compile_(EAGER_OPS.rope),
    )
