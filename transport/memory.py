"""Host memory for transports: raw views of registered addresses, and buffers an RDMA NIC can
register cheaply.

RDMA NICs translate every registered page: 4 KiB pages exhaust an HCA's translation budget at a
few GB, 2 MiB pages do not. `HostBuffer(huge_pages=True)` therefore asks for transparent huge
pages (MADV_HUGEPAGE), faults every page in (MADV_POPULATE_WRITE), and then verifies in
/proc/self/smaps that the whole mapping really is huge-page backed, failing with the setting to
change otherwise. `pin()` registers the buffer with CUDA so device copies into it are DMA.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_MADV_COLLAPSE = 25  # Linux >= 6.1: collapse into huge pages now, compacting memory if needed
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of host memory at `addr` (the caller guarantees it is mapped)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class HostBuffer:
    """An anonymous, page-aligned host mapping of `nbytes` (rounded up to whole huge pages when
    huge_pages), zero-filled."""

    def __init__(self, nbytes: int, huge_pages: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes: {nbytes} must be positive")
        if huge_pages:
            nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # One huge page of slack lets the start be aligned to 2 MiB (mmap aligns to 4 KiB).
        slack = HUGE_PAGE if huge_pages else 0
        self._map = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.addr = -(-base // HUGE_PAGE) * HUGE_PAGE if huge_pages else base
        self.nbytes = nbytes
        self._offset = self.addr - base
        self._pinned = False
        if huge_pages:
            self._back_with_huge_pages()

    def view(self) -> memoryview:
        return memoryview(self._map)[self._offset : self._offset + self.nbytes]

    def pin(self) -> None:
        """Page-locks the buffer with the CUDA runtime (cudaHostRegister), for DMA copies."""
        import torch  # only buffers that are pinned need torch (and CUDA)

        result = torch.cuda.cudart().cudaHostRegister(self.addr, self.nbytes, 0)
        if int(result) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed: {result}")
        self._pinned = True

    def close(self) -> None:
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.addr)
            self._pinned = False
        if not self._map.closed:
            self._map.close()

    def _back_with_huge_pages(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for advice, name in ((_MADV_HUGEPAGE, "MADV_HUGEPAGE"), (_MADV_POPULATE_WRITE, "POP")):
            if libc.madvise(self.addr, self.nbytes, advice) != 0:
                errno = ctypes.get_errno()
                self.close()
                raise RuntimeError(
                    f"madvise({name}) failed (errno {errno}): this kernel lacks transparent huge "
                    f"pages or MADV_POPULATE_WRITE (Linux >= 5.14)"
                )
        huge = huge_bytes_in(self.addr, self.nbytes)
        if huge < self.nbytes:
            # Fragmented memory gave some 4 KiB pages at fault time; ask again, synchronously
            # (an older kernel refuses the advice, and the check below speaks for it).
            libc.madvise(self.addr, self.nbytes, _MADV_COLLAPSE)
            huge = huge_bytes_in(self.addr, self.nbytes)
        if huge < self.nbytes:
            setting = _THP_ENABLED.read_text().strip() if _THP_ENABLED.exists() else "absent"
            self.close()
            raise RuntimeError(
                f"only {huge} of {self.nbytes} bytes are backed by 2 MiB huge pages; an RDMA NIC "
                f"would need a translation entry per 4 KiB page. {_THP_ENABLED} is [{setting}]: "
                f"set it to 'madvise' or 'always' (and /sys/kernel/mm/transparent_hugepage/defrag "
                f"to 'madvise'), or free memory so the kernel can find contiguous 2 MiB pages"
            )


def huge_bytes_in(addr: int, nbytes: int) -> int:
    """Bytes of [addr, addr + nbytes) that /proc/self/smaps reports as AnonHugePages."""
    total = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < addr + nbytes and addr < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return min(total, nbytes)
