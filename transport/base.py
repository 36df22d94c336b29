"""The KV data plane's one interface: one-sided writes of (address, length) runs into a peer's
registered memory, with a deadline on every operation.

Life of a transfer:
  receiver: register(regions) -> endpoint() bytes, published (in the decode server's ticket)
  sender:   register(its staging memory) -> connect(receiver endpoint, deadline) -> Peer
            write(peer, [WriteOp...], deadline, notify?) -> Transfer
            Transfer.poll() -> PENDING | DONE | FAILED, or Transfer.wait() (raises on failure)
  receiver: notifications() -> the `notify` payloads of completed transfers, if asked for

Every failure is an exception of this module, carrying the backend's reason, within the
operation's deadline: a peer that died -> TransferError promptly; a peer that stopped answering
-> DeadlineExceeded at the deadline; a write outside the peer's registered regions -> TransferError
before any byte moves. The transport moves bytes and knows nothing of models or KV layouts.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class TransportError(Exception):
    """Base of every transport failure; the message carries the backend's reason."""


class TransferError(TransportError):
    """A transfer failed (peer gone, bad address, backend error)."""


class HandshakeError(TransportError):
    """connect() failed: the endpoint is malformed, unreachable, or of another backend."""


class DeadlineExceeded(TransportError):
    """The operation did not complete by its deadline (the peer may be stopped or overloaded)."""


@dataclass(frozen=True)
class Region:
    """A registered range of memory: host (device "cpu") or GPU ("cuda:N")."""

    addr: int
    nbytes: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.addr <= 0 or self.nbytes <= 0:
            raise ValueError(f"region: addr {self.addr:#x} and nbytes {self.nbytes} must be > 0")

    @property
    def end(self) -> int:
        return self.addr + self.nbytes

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.end


@dataclass(frozen=True)
class WriteOp:
    """Copy nbytes from a local address to a remote one (both inside registered regions)."""

    src: int
    dst: int
    nbytes: int


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Transfer(abc.ABC):
    """One write() in flight."""

    @abc.abstractmethod
    def poll(self) -> TransferState:
        """Non-blocking; past the deadline a pending transfer becomes FAILED (DeadlineExceeded)."""

    @abc.abstractmethod
    def error(self) -> TransportError | None:
        """Why the transfer failed, once poll() says FAILED."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stops waiting; bytes already sent may have landed."""

    def wait(self, poll_interval: float = 0.0005) -> None:
        """Blocks until DONE; raises the transfer's error if it FAILED."""
        while (state := self.poll()) is TransferState.PENDING:
            time.sleep(poll_interval)
        if state is TransferState.FAILED:
            raise self.error() or TransferError("transfer failed")


class SettledTransfer(Transfer):
    """A write that finished inside write() (a synchronous copy, nothing to move, or a failure
    found before any I/O): done, or failed with `error`."""

    def __init__(self, error: TransportError | None) -> None:
        self._error = error

    def poll(self) -> TransferState:
        return TransferState.FAILED if self._error else TransferState.DONE

    def error(self) -> TransportError | None:
        return self._error

    def abort(self) -> None:
        pass  # already complete


class Peer(abc.ABC):
    """A connected remote agent: what write() needs to reach it."""

    regions: Sequence[Region]
    """The peer's registered regions, from its endpoint: writes are checked against them."""

    def usable(self) -> bool:
        """False once the connection is known lost for good (connect again). Backends whose
        library re-establishes connections itself always say True."""
        return True

    def check(self, ops: Sequence[WriteOp]) -> None:
        """Raises TransferError for any op outside the peer's regions, before any I/O."""
        for op in ops:
            if op.nbytes < 0:
                raise TransferError(f"write of {op.nbytes} bytes to {op.dst:#x}")
            if op.nbytes and not any(r.contains(op.dst, op.nbytes) for r in self.regions):
                raise TransferError(
                    f"write of {op.nbytes} bytes to {op.dst:#x} is outside the peer's "
                    f"registered regions"
                )


class Transport(abc.ABC):
    """One agent of a backend: registers local memory, connects to peers, writes to them."""

    name: str
    one_sided: bool
    """True when writes complete without the peer's CPU (RDMA, cross-memory attach): a stopped
    peer cannot stall them. False when the peer's process receives the bytes (TCP)."""
    _closed: bool
    """True once close() has begun: write() then fails every transfer at once."""

    @abc.abstractmethod
    def register(self, addr: int, nbytes: int, device: str = "cpu") -> Region:
        """Makes [addr, addr + nbytes) usable as a source or destination. Call endpoint() again
        afterwards: peers only accept writes into regions their copy of the endpoint lists."""

    @abc.abstractmethod
    def deregister(self, region: Region) -> None: ...

    @abc.abstractmethod
    def endpoint(self) -> bytes:
        """What a peer needs to connect and write here (TransportEndpoint.metadata)."""

    @abc.abstractmethod
    def connect(self, endpoint: bytes, deadline: float) -> Peer:
        """Connects to the agent that published `endpoint`; raises HandshakeError."""

    def write(
        self,
        peer: Peer,
        ops: Sequence[WriteOp],
        deadline: float,
        notify: bytes | None = None,
    ) -> Transfer:
        """Starts one-sided writes; `notify` is delivered to the peer's notifications() once
        every byte has landed. `deadline` is absolute, in time.monotonic() seconds.

        The same for every backend, before any I/O: an op outside the peer's regions, or whose
        source is not registered here, raises TransferError (as does a notify the backend cannot
        carry); then a closed transport fails the transfer, a write with nothing to move and
        nothing to notify is DONE, and one whose deadline has passed fails (DeadlineExceeded).
        Zero-length ops move nothing: the backend never sees them."""
        notify = notify or b""
        peer.check(ops)
        ops = [op for op in ops if op.nbytes]
        self._check_local(ops, notify)
        if self._closed:
            return SettledTransfer(TransferError(f"{self.name}: transport closed"))
        if not ops and not notify:
            return SettledTransfer(None)
        if time.monotonic() >= deadline:
            error = DeadlineExceeded(f"{self.name}: the deadline passed before the write started")
            return SettledTransfer(error)
        return self._write(peer, ops, deadline, notify)

    @abc.abstractmethod
    def _check_local(self, ops: Sequence[WriteOp], notify: bytes) -> None:
        """Raises TransferError for what this agent cannot send: an op whose source it has not
        registered, a notify payload the backend cannot carry."""

    @abc.abstractmethod
    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float, notify: bytes) -> Transfer:
        """write() once its checks passed: a peer of this backend, at least one op or a notify,
        every op non-empty and inside registered regions on both sides, time left."""

    @abc.abstractmethod
    def notifications(self) -> list[bytes]:
        """Notify payloads of transfers into this agent that completed since the last call."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases every listener, thread and registration; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegionTable:
    """One agent's registered regions, thread-safe: what its endpoint advertises, what its
    writes may read from and what peers may write into."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._regions: list[Region] = []
        self._lock = threading.Lock()

    def add(self, region: Region) -> Region:
        with self._lock:
            self._regions.append(region)
        return region

    def remove(self, region: Region) -> None:
        with self._lock:
            self._regions.remove(region)

    def pairs(self) -> list[list[int]]:
        """[[addr, nbytes], ...], as endpoints publish them."""
        with self._lock:
            return [[r.addr, r.nbytes] for r in self._regions]

    def contains(self, addr: int, nbytes: int) -> bool:
        with self._lock:
            return any(r.contains(addr, nbytes) for r in self._regions)

    def check_sources(self, ops: Sequence[WriteOp]) -> None:
        """Raises TransferError for any op whose source is outside these regions."""
        for op in ops:
            if op.nbytes and not self.contains(op.src, op.nbytes):
                raise TransferError(
                    f"{self.backend}: source {op.src:#x}+{op.nbytes} is not registered here"
                )


class HostTransport(Transport):
    """A backend that reaches host memory itself (tcp, shm): registering a region only records
    it, for the endpoint to advertise and for write() to check sources against. GPU memory is
    refused by name."""

    def __init__(self) -> None:
        self._regions = RegionTable(self.name)
        self._closed = False

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> Region:
        if device != "cpu":
            raise ValueError(
                f"{self.name}: cannot register {device} memory (host memory only; use nixl)"
            )
        return self._regions.add(Region(addr, nbytes, device))

    def deregister(self, region: Region) -> None:
        self._regions.remove(region)

    def _check_local(self, ops: Sequence[WriteOp], notify: bytes) -> None:
        self._regions.check_sources(ops)


def endpoint_bytes(backend: str, regions: list[list], **fields: object) -> bytes:
    """An endpoint as every backend publishes it: a JSON object naming the backend first and
    listing the registered regions last ([addr, nbytes] or [addr, nbytes, device] each)."""
    return json.dumps({"transport": backend, **fields, "regions": regions}).encode()


@contextlib.contextmanager
def reading_endpoint(backend: str, endpoint: bytes) -> Iterator[dict]:
    """Yields the endpoint's JSON object once it names `backend`. A malformed endpoint raises
    HandshakeError, and so does a field that the with-block finds missing or of the wrong type
    (a KeyError, ValueError, TypeError or IndexError raised inside it)."""
    try:
        info = json.loads(endpoint)
        kind = info.get("transport") if isinstance(info, dict) else None
        if kind != backend:
            raise HandshakeError(f"{backend}: endpoint is for {kind!r}")
        yield info
    except (ValueError, KeyError, TypeError, IndexError) as e:  # JSON errors are ValueErrors
        raise HandshakeError(f"{backend}: malformed endpoint: {e}") from None


def remaining(deadline: float) -> float:
    """Seconds left until `deadline` (time.monotonic), never negative."""
    return max(0.0, deadline - time.monotonic())
