"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A kernel launched with PDL may start while the kernel before it is finishing: its programs
become resident and wait, inside the kernel, for that kernel to complete (`gdc_wait`), so the
launch latency between consecutive kernels of a captured decode graph is hidden. Each kernel also
lets the next one launch as soon as all its own programs are running (`gdc_launch_dependents`).

NOTE: a kernel launched with PDL that never waited would run concurrently with its predecessor.
Every kernel launched with `launch_pdl=enabled(device)` must call `await_previous_kernel(PDL)`
before its first load or store of memory another kernel touches.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine import triton_device

__all__ = ["await_previous_kernel", "enabled"]


def enabled(device: torch.device) -> bool:
    """On CUDA only: Triton's CPU interpreter (tests) has no grid dependencies."""
    return triton_device.compiled(device)


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def await_previous_kernel_then_release(PDL: tl.constexpr):
    """await_previous_kernel, but the next kernel may launch only once every program has
    waited: so it may read, before its own wait, what the kernel before this one wrote (the
    routing that picks a kernel's weights, say), though not what this one writes."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
