"""engine.host_values: host lists and tensors on the device, without waiting for it.

python -m pytest -q engine/tests/host_values_test.py   # the cuda case on a GPU only
"""

import pytest
import torch

from engine.host_values import to_device

cuda = pytest.mark.cuda  # needs a GPU


def test_values_and_dtypes_as_torch_tensor_infers_or_as_asked():
    cpu = torch.device("cpu")
    assert to_device([3, 1, 2], cpu).dtype == torch.int64
    assert to_device([True, False], cpu).tolist() == [True, False]
    assert to_device([0.5, 2.0], cpu).dtype == torch.float32
    assert to_device([], cpu, torch.long).shape == (0,)
    halves = to_device(torch.tensor([1, 2]), cpu, torch.int32)
    assert halves.dtype == torch.int32 and halves.tolist() == [1, 2]
    rows = to_device([[1, 2], [3, 4]], cpu)
    assert rows.shape == (2, 2) and rows.tolist() == [[1, 2], [3, 4]]


@cuda
def test_the_copy_is_queued_behind_running_kernels_not_waited_for():
    """A pageable copy returns only once the kernels queued before it have run; this one
    returns while they still run, and lands in stream order with the right values."""
    device = torch.device("cuda")
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(100_000_000)  # a kernel that spins for tens of milliseconds
    torch.tensor([7], device=device)
    assert stream.query(), "torch's pageable copy no longer waits: this module is moot"
    torch.cuda._sleep(100_000_000)
    values = to_device([[1, 2], [3, 4]], device, torch.int32)
    running = not stream.query()
    torch.cuda.synchronize()
    assert running
    assert values.device.type == "cuda" and values.dtype == torch.int32
    assert values.tolist() == [[1, 2], [3, 4]]
