"""How this process runs Triton kernels: compiled for the GPU, or by Triton's CPU interpreter.

Import this module before triton (and before the kernels' modules). Without CUDA it sets
TRITON_INTERPRET=1, so kernels defined afterwards run on CPU tensors through the interpreter.
NOTE: @triton.jit picks interpreted or compiled when a function is defined, triton's own library
(tl.sum, tl.cdiv) included. A process that imported triton before TRITON_INTERPRET=1 was set (HF
models import it) cannot interpret kernels: `mode_error` then says how to run the tests.
"""

import contextlib
import os

import numpy as np
import pytest
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


@contextlib.contextmanager
def runnable(kernel):
    """Fails the tests inside if `kernel` can run in neither mode; in interpreter mode, works
    around four Triton 3.6 interpreter bugs, leaving the kernels' code path unchanged.

    NOTE: (1) `range()` over a tensor bound calls int() on a 1-element array, which numpy >= 2.4
    rejects (triton-lang/triton#9171, fixed after 3.6). (2) tl.dot multiplies bf16 operands as
    their uint16 bit patterns; they are widened to fp32 exactly first, as the GPU does. (3) fp32
    -> bf16 casts truncate the mantissa, where the GPU rounds to nearest even; truncation biases
    every rounded intermediate towards zero (a 1.6% error in a MoE layer). (4) fp32 -> e4m3
    casts round wrongly (84.0 -> 88 where the GPU gives 80, 31.875 -> 16); torch's cast rounds
    to nearest even, as the GPU does.
    """
    if error := mode_error(kernel):
        pytest.fail(error)  # every test errors, loudly; other test files still run
    if not interpreted(kernel):
        yield
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot
    cast_impl = interpreter.InterpreterBuilder.cast_impl
    fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def patch_tensor_fixed(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot_fixed(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl_fixed(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = np.asarray(src.data, dtype=np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> 16
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    def fp_to_fp_fixed(self, src, dst_type, rounding_mode):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.float8e4nv:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        wide = torch.from_numpy(np.asarray(src.data, dtype=np.float32))
        narrow = wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(narrow, tl.float8e4nv)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch_tensor_fixed)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_fixed)
        mp.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl_fixed)
        mp.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", fp_to_fp_fixed)
        yield


def cuda_only(test):
    """Marked `cuda` (deselected by `-m "not cuda"`) and skipped in interpreter mode: compiled
    kernels on a GPU only (real shapes would take minutes interpreted; CUDA graphs)."""
    skip = pytest.mark.skipif(interpreted(tl.standard.zeros), reason="needs compiled kernels")
    return pytest.mark.cuda(skip(test))
