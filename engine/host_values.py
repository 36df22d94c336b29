"""Host values copied to the device without waiting for it.

`torch.tensor(values, device=cuda)` and a CPU tensor's `.to(cuda)` copy from pageable memory,
and such a copy waits for every kernel queued before it: in a step that builds small inputs
between its kernels (a speculative step's drafts and their verification, a sampled request's
temperatures, a prefill chunk's attention metadata), each one drains the device's queue, and the
device idles while the host prepares what follows. From pinned memory the copy is queued behind
the kernels like one of them, and the host goes on. (The pinned block is not reused before the
copy has run: torch's caching host allocator records the copy's stream.)
"""

from collections.abc import Sequence

import torch

__all__ = ["to_device"]


def to_device(
    values: Sequence | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """values (a list, or a CPU tensor) as a tensor on `device`, in `dtype` if given (a list's
    own, as torch.tensor infers it, otherwise)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
