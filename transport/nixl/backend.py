"""NIXL transport: one-sided writes through a NIXL agent and its UCX backend.

UCX picks the path for each pair of memories: cross-memory attach (process_vm_writev) between
processes of one host for host memory, cuda_ipc (NVLink) between GPUs of one host, RDMA between
hosts, TCP as the last resort. Once a UCX endpoint is wired up, writes need nothing of the peer's
CPU; the wire-up itself needs one answer from the peer, so connect() completes it at once with a
1-byte probe read of the peer's memory. A dead or closed peer therefore fails connect(), and a
peer stopped after connect() cannot stall a write. A write's `notify` travels as a NIXL
notification (a UCX active message), which NIXL sends only after flushing the transfer's bytes.
Two caveats. Cross-memory attach copies inside write() itself, so the deadline is checked only
when the copy returns; RDMA and cuda_ipc copies run in the background. And a UCX left with TCP
alone emulates remote writes with messages that the peer's progress thread applies, so a stopped
peer then stalls writes until their deadline.

GPU memory: register(addr, n, "cuda:N") registers NIXL VRAM_SEG memory with device id N, and each
descriptor carries its region's device id (see _memory). This needs a UCX built with CUDA, as the
wheel's UCX is; the CPU-only dev machines exercise host memory only.

Endpoint: JSON {"transport": "nixl", "agent": name, "metadata": base64 of the agent's NIXL
metadata (UCX worker address and remote keys), "regions": [[addr, nbytes, device], ...]}.

Threads: each agent runs NIXL's progress thread (it answers peers' wire-up and takes notifications
while Python is busy or blocked) and UCX's async thread. Both are native, so `threading` does not
count them, and both are joined when close() drops the agent. NIXL also imports numpy, and
numpy's OpenBLAS starts its own thread pool (unless OMP_NUM_THREADS=1), which lasts as long as the
process.

Binding: UCX's TCP transport listens on the address of every network device it selects, on an
ephemeral port (it never binds the wildcard address); cross-memory attach and cuda_ipc listen on
nothing. A loopback `host` selects only `lo` (UCX NET_DEVICES=lo), so nothing outside this host
can reach the agent. Any other host leaves every device selected, because NET_DEVICES names
devices, not addresses, and narrowing it to the host's interface would also drop the RDMA NICs.
To narrow it, pass ucx_options={"NET_DEVICES": "eth0"}; to fix the ports, pass
{"TCP_PORT_RANGE": "40000-40100"}. UCX_* environment variables win over both, because NIXL only
applies a setting when the environment has none.

NOTE: this module calls NIXL's pybind layer (`nixl_cu13._bindings`), not its Python `nixl_agent`
wrapper. The wrapper hard-codes a progress-thread poll interval of 0, so its progress thread
spins a whole core per agent (measured: 2.0 CPU-seconds per idle second). Here the thread sleeps
on the UCX worker's event fd and wakes at least every _PROGRESS_POLL_US.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import functools
import ipaddress
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
from nixl_cu13 import _bindings as nixl

from transport.base import (
    DeadlineExceeded,
    HandshakeError,
    Peer,
    Region,
    SettledTransfer,
    Transfer,
    TransferError,
    TransferState,
    Transport,
    TransportError,
    WriteOp,
    endpoint_bytes,
    reading_endpoint,
)

_PROGRESS_POLL_US = 10_000  # the progress thread wakes on UCX events, and at least this often
# The pybind layer raises one exception class per NIXL status; their only common base is Exception.
_NIXL_ERRORS = tuple(
    value for key, value in vars(nixl).items() if key.startswith("nixl") and key.endswith("Error")
)


class NixlTransport(Transport):
    name = "nixl"
    one_sided = True

    def __init__(
        self, host: str = "127.0.0.1", *, ucx_options: Mapping[str, str] | None = None
    ) -> None:
        """ucx_options: UCX settings for this agent, named without the UCX_ prefix, e.g.
        {"KEEPALIVE_INTERVAL": "2s"}. Values cannot contain commas, because NIXL splits its
        engine_config on them."""
        settings = dict(ucx_options or {})
        for key, value in settings.items():
            if not key or "=" in key or "," in key + value:
                raise ValueError(f"ucx_options: {key}={value} cannot be passed on to UCX by NIXL")
        if _is_loopback(host):
            settings.setdefault("NET_DEVICES", "lo")
        config = nixl.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False  # metadata travels in endpoint(), not via NIXL's listener
        config.pthrDelay = _PROGRESS_POLL_US
        config.syncMode = nixl.NIXL_THREAD_SYNC_STRICT  # callers may write and poll from threads
        self._name = f"tandem-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent: nixl.nixlAgent | None = nixl.nixlAgent(self._name, config)
        # NOTE: a dead peer is detected by UCX's PEER error-handling mode. It is NIXL's default,
        # but we set it explicitly because we rely on it. When any lane to the peer fails
        # (process_vm_writev gets ESRCH, the TCP lane reads the reset that the dead process's
        # kernel sends, an RDMA work request completes in error), UCX calls NIXL's endpoint error
        # handler and NIXL marks the peer disconnected. The transfer in flight and every later post
        # then raise nixlRemoteDisconnectError, which becomes TransferError. On one host this is
        # immediate (measured: under 1 ms after SIGKILL). If a remote machine vanishes without
        # resetting its connections, only UCX keepalive (KEEPALIVE_INTERVAL, 20 s by default) or
        # the RDMA retry timeout notice; lower them through ucx_options where that matters. A
        # stopped peer is never declared dead: the write's deadline is then the only limit (UCX
        # over TCP has no timeout of its own).
        backend = {
            "ucx_error_handling_mode": "peer",
            "engine_config": ",".join(f"{key}={value}" for key, value in settings.items()),
        }
        try:
            self._agent.createBackend("UCX", backend)
        except _NIXL_ERRORS as e:
            raise TransportError(f"nixl: UCX backend did not start with {settings}: {e}") from None
        self._lock = threading.Lock()
        self._regions: dict[Region, nixl.nixlRegDList] = {}
        self._table = _RegionTable([])
        self._remotes: set[str] = set()
        self._transfers: set[_NixlTransfer] = set()
        self._closed = False
        # connect()'s probe reads one byte of the peer's memory into this buffer.
        self._probe = ctypes.create_string_buffer(1)
        self._probe_addr = ctypes.addressof(self._probe)
        self._probe_descs = nixl.nixlRegDList(nixl.DRAM_SEG, [(self._probe_addr, 1, 0, "")])
        self._agent.registerMem(self._probe_descs, [])

    # -- local memory --------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> Region:
        region = Region(addr, nbytes, device)
        memory, device_id = _memory(device)
        if region in self._regions:
            raise ValueError(f"nixl: {region} is already registered")
        descs = nixl.nixlRegDList(memory, [(addr, nbytes, device_id, "")])
        try:
            self._live().registerMem(descs, [])
        except _NIXL_ERRORS as e:
            hint = ""
            if memory == nixl.VRAM_SEG:  # NOTE: NIXL 1.5.1 still lists the failed region then
                hint = (
                    f" (no CUDA for UCX here, or the memory is not on {device}; this agent's "
                    "metadata now names the failed region and peers refuse to load it: close it)"
                )
            raise TransportError(
                f"nixl: cannot register {nbytes} bytes of {device} memory at {addr:#x}: {e}{hint}"
            ) from None
        with self._lock:
            self._regions[region] = descs
            self._table = _RegionTable(list(self._regions))
        return region

    def deregister(self, region: Region) -> None:
        with self._lock:
            descs = self._regions.pop(region, None)
            if descs is None:
                raise ValueError(f"nixl: {region} is not registered")
            self._table = _RegionTable(list(self._regions))
        try:
            self._live().deregisterMem(descs, [])
        except _NIXL_ERRORS as e:
            raise TransportError(f"nixl: cannot deregister {region}: {e}") from None

    def endpoint(self) -> bytes:
        metadata = self._live().getLocalMD()
        with self._lock:
            regions = [[r.addr, r.nbytes, r.device] for r in self._regions]
        metadata = base64.b64encode(metadata).decode()
        return endpoint_bytes("nixl", regions, agent=self._name, metadata=metadata)

    # -- sending -------------------------------------------------------------------------------

    def connect(self, endpoint: bytes, deadline: float) -> Peer:
        with reading_endpoint("nixl", endpoint) as info:  # base64 errors are ValueErrors
            name = str(info["agent"])
            metadata = base64.b64decode(info["metadata"], validate=True)
            regions = [Region(int(a), int(n), str(d)) for a, n, d in info["regions"]]
            for region in regions:
                _memory(region.device)
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"nixl: deadline passed before connecting to {name!r}")
        # Loading an agent again (its endpoint now lists more regions) merges the new metadata.
        try:
            loaded = self._live().loadRemoteMD(metadata).decode()
        except _NIXL_ERRORS as e:
            raise HandshakeError(f"nixl: cannot load the metadata of agent {name!r}: {e}") from None
        with self._lock:
            self._remotes.add(loaded)
        if loaded != name:
            raise HandshakeError(f"nixl: endpoint names agent {name!r}, its metadata {loaded!r}")
        peer = _NixlPeer(name, regions)
        self._probe_peer(peer, deadline)
        return peer

    def _check_local(self, ops: Sequence[WriteOp], notify: bytes) -> None:
        _source_regions(ops, self._table)

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float, notify: bytes) -> Transfer:
        assert isinstance(peer, _NixlPeer)
        if ops:
            local, remote = _descriptors(ops, self._table, peer.table)
            transfer = _NixlTransfer(self, deadline)
            transfer.start(nixl.NIXL_WRITE, local, remote, peer.name, notify)
            return transfer
        try:
            self._live().genNotif(peer.name, notify, [])
        except _NIXL_ERRORS as e:
            return SettledTransfer(_failure(e))
        return SettledTransfer(None)

    # -- receiving -----------------------------------------------------------------------------

    def notifications(self) -> list[bytes]:
        agent = self._agent
        if agent is None:
            return []
        try:
            notes = agent.getNotifs({}, [])
        except _NIXL_ERRORS as e:
            raise TransportError(f"nixl: cannot read notifications: {e}") from None
        return [note for payloads in notes.values() for note in payloads]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            transfers = list(self._transfers)
            remotes = list(self._remotes)
            registrations = [*self._regions.values(), self._probe_descs]
            self._regions.clear()
        for transfer in transfers:
            transfer.abort()  # releases its NIXL request
        agent, self._agent = self._agent, None
        for name in remotes:
            with contextlib.suppress(*_NIXL_ERRORS):
                agent.invalidateRemoteMD(name)
        for descs in registrations:
            with contextlib.suppress(*_NIXL_ERRORS):
                agent.deregisterMem(descs, [])
        # The transport held the only reference: the agent's destructor joins NIXL's progress
        # thread and UCX's async thread, and closes UCX's endpoints and listening sockets.
        del agent

    # -- internals -----------------------------------------------------------------------------

    def _live(self) -> nixl.nixlAgent:
        agent = self._agent
        if agent is None:
            raise TransportError("nixl: transport is closed")
        return agent

    def _track(self, transfer: _NixlTransfer) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("nixl: transport is closed")
            self._transfers.add(transfer)

    def _forget(self, transfer: _NixlTransfer) -> None:
        with self._lock:
            self._transfers.discard(transfer)

    def _probe_peer(self, peer: _NixlPeer, deadline: float) -> None:
        """Reads one byte of the peer's memory. This completes UCX's wire-up, the one step that
        needs the peer's (progress) thread, and proves the peer alive. A peer that has no regions
        is wired up by the first notification sent to it instead."""
        if not peer.regions:
            return
        target = min(peer.regions, key=lambda r: r.device != "cpu")  # host memory if it has any
        memory, device_id = _memory(target.device)
        local = nixl.nixlXferDList(nixl.DRAM_SEG, [(self._probe_addr, 1, 0)])
        remote = nixl.nixlXferDList(memory, [(target.addr, 1, device_id)])
        probe = _NixlTransfer(self, deadline)
        probe.start(nixl.NIXL_READ, local, remote, peer.name, b"")
        try:
            probe.wait()
        except DeadlineExceeded:
            raise DeadlineExceeded(f"nixl: agent {peer.name!r} did not answer in time") from None
        except TransferError as e:
            raise HandshakeError(f"nixl: agent {peer.name!r} is unreachable: {e}") from None


class _NixlPeer(Peer):
    def __init__(self, name: str, regions: list[Region]) -> None:
        self.name = name
        self.regions = regions
        self.table = _RegionTable(regions)


class _NixlTransfer(Transfer):
    """One NIXL transfer request. poll() asks NIXL for its state and releases the request as soon
    as it is settled; past the deadline, releasing it cancels the UCX operations still pending."""

    def __init__(self, owner: NixlTransport, deadline: float) -> None:
        self.deadline = deadline
        self._owner = owner
        self._lock = threading.Lock()  # NIXL must never see a handle that is already released
        self._handle: int | None = None
        self._state = TransferState.PENDING
        self._error: TransportError | None = None

    def start(
        self,
        op: nixl.nixl_xfer_op_t,
        local: nixl.nixlXferDList,
        remote: nixl.nixlXferDList,
        peer: str,
        notify: bytes,
    ) -> None:
        """Posts the request; raises TransportError if the transport has closed."""
        self._owner._track(self)
        with self._lock:
            if self._state is not TransferState.PENDING:
                return  # the transport closed before the transfer started
            agent = self._owner._agent
            try:
                self._handle = agent.createXferReq(op, local, remote, peer, notify, [])
                self._update(agent.postXferReq(self._handle))
            except _NIXL_ERRORS as e:
                self._settle(_failure(e))

    def poll(self) -> TransferState:
        with self._lock:
            if self._state is TransferState.PENDING:
                try:
                    self._update(self._owner._agent.getXferStatus(self._handle))
                except _NIXL_ERRORS as e:
                    self._settle(_failure(e))
            if self._state is TransferState.PENDING and time.monotonic() >= self.deadline:
                self._settle(DeadlineExceeded("nixl: transfer not complete by its deadline"))
            return self._state

    def error(self) -> TransportError | None:
        return self._error

    def abort(self) -> None:
        with self._lock:
            if self._state is TransferState.PENDING:
                self._settle(TransferError("nixl: transfer aborted"))

    def _update(self, status: nixl.nixl_status_t) -> None:
        if status == nixl.NIXL_SUCCESS:
            self._settle(None)
        elif status != nixl.NIXL_IN_PROG:
            self._settle(TransferError(f"nixl: transfer failed: {status.name}"))

    def _settle(self, error: TransportError | None) -> None:
        handle, self._handle = self._handle, None
        self._error = error
        self._state = TransferState.FAILED if error else TransferState.DONE
        if handle is not None:
            # NOTE: a request NIXL cannot cancel stays allocated until the agent is destroyed.
            with contextlib.suppress(*_NIXL_ERRORS):
                self._owner._agent.releaseXferReq(handle)
        self._owner._forget(self)


class _RegionTable:
    """Regions sorted by address, to locate many runs at once."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.regions = sorted(regions, key=lambda r: r.addr)
        self._starts = np.array([r.addr for r in self.regions], dtype=np.int64)
        self._ends = np.array([r.end for r in self.regions], dtype=np.int64)
        memories = [_memory(r.device) for r in self.regions]
        self.device_ids = np.array([device_id for _, device_id in memories], dtype=np.int64)
        self.memories = [memory for memory, _ in memories]
        self.host = np.array([memory == nixl.DRAM_SEG for memory in self.memories])
        """Per region: host memory (else GPU), to refuse a list that mixes the two."""

    def locate(self, addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """The index of the region holding each run [addr, addr + nbytes), or -1."""
        if not self.regions:
            return np.full(len(addr), -1)
        index = np.searchsorted(self._starts, addr, side="right") - 1
        index[(index < 0) | (addr + nbytes > self._ends[np.maximum(index, 0)])] = -1
        for k in np.flatnonzero(index < 0):  # where regions overlap, an earlier one may hold it
            run = int(addr[k]), int(nbytes[k])
            index[k] = next((i for i, r in enumerate(self.regions) if r.contains(*run)), -1)
        return index


def _descriptors(
    ops: Sequence[WriteOp], local: _RegionTable, remote: _RegionTable
) -> tuple[nixl.nixlXferDList, nixl.nixlXferDList]:
    """NIXL descriptor lists for non-empty ops (which the peer has already checked). A run that
    continues the previous one on both sides, within the same regions, is merged into it: the
    number of descriptors, not bytes, bounds NIXL's rate."""
    src, size, src_region = _source_regions(ops, local)
    dst = np.fromiter((op.dst for op in ops), np.int64, len(ops))
    dst_region = remote.locate(dst, size)
    assert (dst_region >= 0).all(), "ops outside the peer's regions passed Peer.check"
    head = np.ones(len(ops), dtype=bool)
    head[1:] = (
        (src[1:] != src[:-1] + size[:-1])
        | (dst[1:] != dst[:-1] + size[:-1])
        | (src_region[1:] != src_region[:-1])
        | (dst_region[1:] != dst_region[:-1])
    )
    first = np.flatnonzero(head)
    lengths = np.add.reduceat(size, first)
    return (
        _dlist(local, src_region[first], src[first], lengths),
        _dlist(remote, dst_region[first], dst[first], lengths),
    )


def _source_regions(
    ops: Sequence[WriteOp], local: _RegionTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ops' sources, sizes and source regions' indices; raises TransferError for a source
    outside `local` (checked by write() and again here: a region may go in between)."""
    src = np.fromiter((op.src for op in ops), np.int64, len(ops))
    size = np.fromiter((op.nbytes for op in ops), np.int64, len(ops))
    region = local.locate(src, size)
    if (missing := np.flatnonzero(region < 0)).size:
        op = ops[missing[0]]
        raise TransferError(f"nixl: source {op.src:#x}+{op.nbytes} is not registered here")
    return src, size, region


def _dlist(
    table: _RegionTable, region: np.ndarray, addr: np.ndarray, nbytes: np.ndarray
) -> nixl.nixlXferDList:
    host = table.host[region]
    if host.any() != host.all():
        raise TransferError(
            "nixl: one write cannot mix host and GPU memory on one side (a NIXL descriptor list "
            "has a single memory type): split it"
        )
    rows = np.empty((len(addr), 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addr, nbytes, table.device_ids[region]
    return nixl.nixlXferDList(table.memories[region[0]], rows)


@functools.cache
def _memory(device: str) -> tuple[nixl.nixl_mem_t, int]:
    """NIXL's memory type and device id for a Region.device. "cpu" is host memory (DRAM_SEG,
    id 0). "cuda:N" is memory of this process's CUDA device N (VRAM_SEG, id N); when it registers
    such memory, NIXL checks that the pointer belongs to device N."""
    if device == "cpu":
        return nixl.DRAM_SEG, 0
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        return nixl.VRAM_SEG, int(index)
    raise ValueError(f"nixl: device {device!r} is neither 'cpu' nor 'cuda:N'")


def _failure(error: Exception) -> TransferError:
    if isinstance(error, nixl.nixlRemoteDisconnectError):
        return TransferError(f"nixl: peer disconnected (it died or closed its agent): {error}")
    return TransferError(f"nixl: {type(error).__name__}: {error}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
