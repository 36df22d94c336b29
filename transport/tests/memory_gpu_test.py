"""Pinned, huge-page host buffers on a CUDA machine: device copies into them run as DMA.

Tagged `gpu`; without Bazel: `PYTHONPATH=. python3 -m pytest transport/tests/memory_gpu_test.py`.
"""

import time

import torch

from transport.memory import HUGE_PAGE, HostBuffer, huge_bytes_in

NBYTES = 256 * 1024 * 1024


def _d2h_gb_s(dst: torch.Tensor, src: torch.Tensor) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - start) / 1e9


def test_pinned_huge_page_buffer_takes_dma_copies_at_pinned_speed():
    src = torch.arange(NBYTES, dtype=torch.uint8, device="cuda")
    buffer = HostBuffer(NBYTES, huge_pages=True)
    try:
        assert huge_bytes_in(buffer.addr, buffer.nbytes) == buffer.nbytes
        assert buffer.addr % HUGE_PAGE == 0
        pageable = torch.frombuffer(buffer.view(), dtype=torch.uint8)
        unpinned = _d2h_gb_s(pageable, src)
        buffer.pin()
        pinned = _d2h_gb_s(pageable, src)
        assert torch.equal(pageable[:4096].cuda(), src[:4096])
        reference = _d2h_gb_s(torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True), src)
        print(
            f"D2H GB/s: pageable {unpinned:.1f}, pinned {pinned:.1f}, torch pinned {reference:.1f}"
        )
        # DMA straight into registered pages runs at the pinned rate, not through a bounce buffer.
        assert pinned > 0.8 * reference
        del pageable
    finally:
        buffer.close()
