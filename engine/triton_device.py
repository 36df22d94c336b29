"""What launching a Triton kernel needs to know of the tensors' device: whether its kernels are
compiled for a GPU or run by Triton's CPU interpreter (tests), and how many SMs it has.

The kernels' wrappers ask here rather than test `device.type` themselves, so that the decisions
a GPU launch makes (PDL, split counts, the interpreter's workarounds left out) can be taken on a
CPU too: `engine/tests/sm90_compile_test.py` compiles every kernel for Hopper that way.
"""

import functools

import torch

__all__ = ["compiled", "sm_count"]


def compiled(device: torch.device) -> bool:
    """Kernels on `device` are compiled (CUDA); elsewhere Triton's interpreter runs them."""
    return device.type == "cuda"


def sm_count(device: torch.device) -> int:
    """The device's SMs; 1 where the interpreter runs programs one at a time, so that nothing
    is split there unless a test asks."""
    if not compiled(device):
        return 1
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
