"""Same-host transport: copies straight into the peer process's memory.

The copy is Linux cross-memory attach (process_vm_writev): one kernel copy from this process's
pages into the peer's, with no shared mapping to set up, so any host memory the peer registered
(a torch tensor, an mmap) is a valid destination. Notifications travel as datagrams on a Unix
socket in the abstract namespace. Needs the same user (or CAP_SYS_PTRACE) on both sides and
ptrace not restricted by Yama (kernel.yama.ptrace_scope <= 1 with a related process, or 0).

A dead peer fails the next copy (ESRCH) at once; a stopped peer does not stop the copy, which
needs nothing of it: only its notification waits for it to run again.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
from collections.abc import Iterator, Sequence

from transport.base import (
    DeadlineExceeded,
    HandshakeError,
    HostTransport,
    Peer,
    Region,
    SettledTransfer,
    Transfer,
    TransferError,
    TransportError,
    WriteOp,
    endpoint_bytes,
    reading_endpoint,
    remaining,
)

_CHUNK = 64 * 1024 * 1024  # bytes per syscall: bounds the time between deadline checks
_MAX_IOV = 1024  # IOV_MAX: descriptors per process_vm_writev call


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t


class ShmTransport(HostTransport):
    name = "shm"
    one_sided = True

    def __init__(self, host: str = "127.0.0.1") -> None:
        del host  # same host only: nothing to bind
        super().__init__()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._address = f"\0tandem-shm-{os.getpid()}-{id(self):x}"
        self._socket.bind(self._address)
        self._socket.setblocking(False)

    def endpoint(self) -> bytes:
        regions = self._regions.pairs()
        return endpoint_bytes("shm", regions, pid=os.getpid(), socket=self._address[1:])

    def connect(self, endpoint: bytes, deadline: float) -> Peer:
        with reading_endpoint("shm", endpoint) as info:
            regions = [Region(a, n) for a, n in info["regions"]]
            peer = _ShmPeer(int(info["pid"]), "\0" + info["socket"], regions)
        try:
            os.kill(peer.pid, 0)
        except ProcessLookupError:
            raise HandshakeError(f"shm: no process {peer.pid} on this host") from None
        return peer

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float, notify: bytes) -> Transfer:
        assert isinstance(peer, _ShmPeer)
        # The copy is synchronous (a kernel memcpy); the transfer is done or failed on return.
        try:
            _copy(peer.pid, ops, deadline)
            if notify:
                peer.notify(notify, deadline)
        except TransportError as e:
            return SettledTransfer(e)
        return SettledTransfer(None)

    def notifications(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self._socket.recv(65536))
            except BlockingIOError:
                return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._socket.close()


class _ShmPeer(Peer):
    def __init__(self, pid: int, address: str, regions: list[Region]) -> None:
        self.pid = pid
        self.regions = regions
        self._address = address

    def notify(self, payload: bytes, deadline: float) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(max(remaining(deadline), 0.001))
            try:
                sock.sendto(payload, self._address)
            except TimeoutError:
                raise DeadlineExceeded("shm: peer did not take the notification in time") from None
            except OSError as e:
                raise TransferError(f"shm: notification to pid {self.pid} failed: {e}") from None


def _copy(pid: int, ops: Sequence[WriteOp], deadline: float) -> None:
    """process_vm_writev in batches of at most _MAX_IOV runs and about _CHUNK bytes, checking
    the deadline between batches."""
    for batch in _batches(ops):
        if time.monotonic() >= deadline:
            raise DeadlineExceeded("shm: copy did not finish by its deadline")
        local = (_IoVec * len(batch))(*[(src, n) for src, _, n in batch])
        remote = (_IoVec * len(batch))(*[(dst, n) for _, dst, n in batch])
        expected = sum(n for _, _, n in batch)
        done = _libc.process_vm_writev(pid, local, len(batch), remote, len(batch), 0)
        if done != expected:
            errno = ctypes.get_errno()
            reason = os.strerror(errno) if done < 0 else f"short copy ({done} of {expected})"
            raise TransferError(f"shm: copy into pid {pid} failed: {reason}")


def _batches(ops: Sequence[WriteOp]) -> Iterator[list[tuple[int, int, int]]]:
    batch: list[tuple[int, int, int]] = []
    size = 0
    for op in ops:
        for start in range(0, op.nbytes, _CHUNK):
            n = min(_CHUNK, op.nbytes - start)
            batch.append((op.src + start, op.dst + start, n))
            size += n
            if len(batch) == _MAX_IOV or size >= _CHUNK:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch
