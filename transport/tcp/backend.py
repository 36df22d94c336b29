"""Pure-Python TCP transport: the sender streams each run, the receiver `recv_into`s it straight
into its registered memory (no intermediate copy), after checking it lies inside a region.

Wire format, sender -> receiver, per transfer:
  DATA  header(kind=1, xfer, addr, nbytes) + nbytes of payload    (one per non-empty WriteOp)
  END   header(kind=2, xfer, 0, len(notify)) + notify              (one per transfer)
and receiver -> sender: ACK(xfer, ok, len(reason)) + reason, once every DATA of xfer landed.
A rejected write (outside the regions) gets a failed ACK and the connection is closed.

One connection per Peer, with a sender thread (transfers go out in order) and an ACK reader;
the receiver runs one thread per accepted connection. Host memory only.
"""

from __future__ import annotations

import itertools
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence

from transport.base import (
    DeadlineExceeded,
    HostTransport,
    Peer,
    Region,
    Transfer,
    TransferError,
    TransferState,
    TransportError,
    WriteOp,
    endpoint_bytes,
    reading_endpoint,
    remaining,
)
from transport.memory import view
from transport.sockets import dial, shutdown

_HEADER = struct.Struct("!BQQQ")
_ACK = struct.Struct("!QBI")
_DATA, _END = 1, 2
_CHUNK = (
    4 * 1024 * 1024
)  # bytes per sendall/recv_into call: bounds the time between deadline checks


class TcpTransport(HostTransport):
    name = "tcp"
    one_sided = False

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._notifications: list[bytes] = []
        self._listener = socket.create_server((host, 0))
        self._host, self._port = self._listener.getsockname()[:2]
        self._connections: set[socket.socket] = set()
        self._peers: list[_TcpPeer] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop, "tcp-accept")

    def endpoint(self) -> bytes:
        return endpoint_bytes("tcp", self._regions.pairs(), host=self._host, port=self._port)

    # -- sending -------------------------------------------------------------------------------

    def connect(self, endpoint: bytes, deadline: float) -> Peer:
        with reading_endpoint("tcp", endpoint) as info:
            address = (info["host"], int(info["port"]))
            regions = [Region(int(a), int(n)) for a, n in info["regions"]]
        peer = _TcpPeer(dial("tcp", address, deadline), regions, self)
        with self._lock:
            self._peers.append(peer)
        return peer

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float, notify: bytes) -> Transfer:
        assert isinstance(peer, _TcpPeer)
        return peer.submit(ops, deadline, notify)

    # -- receiving -----------------------------------------------------------------------------

    def notifications(self) -> list[bytes]:
        with self._lock:
            out, self._notifications = self._notifications, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in self._peers:
            peer.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            shutdown(conn)
        shutdown(self._listener)
        for thread in self._threads:
            thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.add(conn)
            self._spawn(lambda c=conn: self._serve(c), "tcp-recv")

    def _serve(self, conn: socket.socket) -> None:
        """Receives transfers on one connection until it closes or breaks a rule."""
        try:
            while True:
                kind, xfer, addr, nbytes = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                if kind == _DATA:
                    if not self._regions.contains(addr, nbytes):
                        reason = f"write of {nbytes} bytes to {addr:#x} is outside the regions"
                        conn.sendall(_ack(xfer, reason))
                        return  # the stream holds a payload we will not read: drop it
                    _recv_into(conn, view(addr, nbytes))
                elif kind == _END:
                    notify = _recv_exact(conn, nbytes)
                    if notify:
                        with self._lock:
                            self._notifications.append(notify)
                    conn.sendall(_ack(xfer, None))
                else:
                    return
        except (OSError, ConnectionError):
            return
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        # Listed once started: close() joins what is listed, and joining an unstarted thread
        # raises.
        self._threads.append(thread)


class _TcpTransfer(Transfer):
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._done = threading.Event()
        self._error: TransportError | None = None

    def finish(self, error: TransportError | None) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def poll(self) -> TransferState:
        if not self._done.is_set() and time.monotonic() >= self.deadline:
            self.finish(DeadlineExceeded("tcp: transfer not acknowledged by its deadline"))
        if not self._done.is_set():
            return TransferState.PENDING
        return TransferState.FAILED if self._error else TransferState.DONE

    def error(self) -> TransportError | None:
        return self._error

    def abort(self) -> None:
        self.finish(TransferError("tcp: transfer aborted"))

    def wait(self, poll_interval: float = 0.0005) -> None:
        self._done.wait(timeout=remaining(self.deadline))
        super().wait(poll_interval)


class _TcpPeer(Peer):
    """One connection: a sender thread drains the queue in order, a reader thread takes ACKs."""

    def __init__(self, sock: socket.socket, regions: list[Region], owner: TcpTransport) -> None:
        self.regions = regions
        self._sock = sock
        self._ids = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._inflight: dict[int, _TcpTransfer] = {}
        self._lock = threading.Lock()
        self._broken: TransportError | None = None
        owner._spawn(self._send_loop, "tcp-send")
        owner._spawn(self._ack_loop, "tcp-ack")

    def submit(self, ops: Sequence[WriteOp], deadline: float, notify: bytes) -> Transfer:
        transfer = _TcpTransfer(deadline)
        with self._lock:
            if self._broken:
                transfer.finish(TransferError(f"tcp: connection lost earlier: {self._broken}"))
                return transfer
            xfer = next(self._ids)
            self._inflight[xfer] = transfer
        self._queue.put((xfer, ops, notify, transfer))
        return transfer

    def usable(self) -> bool:
        return self._broken is None

    def close(self) -> None:
        self._fail_all(TransferError("tcp: transport closed"))
        self._queue.put(None)

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            xfer, ops, notify, transfer = item
            if transfer.poll() is not TransferState.PENDING:
                continue  # aborted or expired while queued
            try:
                for op in ops:
                    self._send(_HEADER.pack(_DATA, xfer, op.dst, op.nbytes), transfer)
                    self._send(view(op.src, op.nbytes), transfer)
                self._send(_HEADER.pack(_END, xfer, 0, len(notify)) + notify, transfer)
            except TransportError as e:
                self._fail_all(e)  # a half-sent frame leaves the stream unusable
                return

    def _send(self, data, transfer: _TcpTransfer) -> None:
        data = memoryview(data).cast("B")
        for start in range(0, len(data), _CHUNK):
            left = remaining(transfer.deadline)
            if left <= 0:
                raise DeadlineExceeded("tcp: peer did not take the data by the deadline")
            self._sock.settimeout(left)
            try:
                self._sock.sendall(data[start : start + _CHUNK])
            except TimeoutError:
                raise DeadlineExceeded("tcp: peer did not take the data by the deadline") from None
            except OSError as e:
                raise TransferError(f"tcp: connection to peer lost: {e}") from None

    def _ack_loop(self) -> None:
        try:
            while True:
                xfer, ok, size = _ACK.unpack(_recv_exact(self._sock, _ACK.size))
                reason = _recv_exact(self._sock, size).decode() if size else ""
                with self._lock:
                    transfer = self._inflight.pop(xfer, None)
                if transfer is not None:
                    transfer.finish(None if ok else TransferError(f"tcp: peer refused: {reason}"))
        except (OSError, ConnectionError) as e:
            self._fail_all(TransferError(f"tcp: connection to peer lost: {e or 'closed'}"))

    def _fail_all(self, error: TransportError) -> None:
        with self._lock:
            self._broken = self._broken or error
            inflight, self._inflight = self._inflight, {}
        for transfer in inflight.values():
            transfer.finish(error)
        shutdown(self._sock)


def _ack(xfer: int, error: str | None) -> bytes:
    reason = (error or "").encode()
    return _ACK.pack(xfer, error is None, len(reason)) + reason


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, target: memoryview) -> None:
    got = 0
    while got < len(target):
        try:
            n = sock.recv_into(target[got : got + _CHUNK])
        except TimeoutError:
            # A socket has one timeout for both directions: the sender's deadline, not a limit on
            # how long a connection may sit idle (nothing was consumed: read on).
            continue
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n
