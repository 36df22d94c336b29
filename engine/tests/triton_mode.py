"""How this process runs Triton kernels: compiled for the GPU, or by Triton's CPU interpreter.

Import this module before triton (and before the kernels' modules). Without CUDA it sets
TRITON_INTERPRET=1, so kernels defined afterwards run on CPU tensors through the interpreter.
NOTE: @triton.jit picks interpreted or compiled when a function is defined, triton's own library
(tl.sum, tl.cdiv) included. A process that imported triton before TRITON_INTERPRET=1 was set (HF
models import it) cannot interpret kernels: `mode_error` then says how to run the tests.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl


def interpreted(kernel) -> bool:
    return not isinstance(kernel, triton.runtime.JITFunction)


def mode_error(kernel) -> str | None:
    """Why `kernel` can run in neither mode here, or None."""
    if interpreted(tl.standard.zeros) != interpreted(kernel) or not (
        interpreted(kernel) or torch.cuda.is_available()
    ):
        return (
            "triton was imported before TRITON_INTERPRET=1 was set and there is no CUDA: set "
            "TRITON_INTERPRET=1 in the environment, or run this test file in its own process"
        )
    return None


def device_of(kernel) -> str:
    return "cpu" if interpreted(kernel) else "cuda"
