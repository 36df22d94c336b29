"""Mooncake's side channel: a small TCP connection per sender, beside Mooncake's own, that
proves a peer is alive and is the session its endpoint names (HELLO), and carries notify
payloads once a transfer's bytes have landed (NOTIFY). Frames as in transport/tcp: request
(kind, id, payload length) + payload; reply (id, ok). See transport/mooncake/backend.py.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading

from transport.base import DeadlineExceeded, HandshakeError, remaining
from transport.sockets import dial, shutdown

MAX_NOTIFY = 1024 * 1024
REQUEST = struct.Struct("!BQI")  # kind, id, payload length; then the payload
REPLY = struct.Struct("!QB")  # id, ok
HELLO, NOTIFY = 1, 2


def hello(address: tuple[str, int], session: str, deadline: float) -> socket.socket:
    """A side-channel connection to the peer, once it confirmed it is `session`."""
    sock = dial("mooncake", address, deadline)
    try:
        sock.settimeout(max(remaining(deadline), 0.001))
        name = session.encode()
        sock.sendall(REQUEST.pack(HELLO, 0, len(name)) + name)
        _, ok = REPLY.unpack(recv_exact(sock, REPLY.size))
    except TimeoutError:
        shutdown(sock)
        raise DeadlineExceeded(f"mooncake: {address} did not answer by the deadline") from None
    except OSError as e:
        shutdown(sock)
        raise HandshakeError(f"mooncake: handshake with {address} failed: {e}") from None
    if not ok:
        shutdown(sock)
        raise HandshakeError(f"mooncake: the agent at {address} is not {session} (stale endpoint)")
    sock.setblocking(False)
    return sock


class NotifyListener:
    """The side channel's receiving end on `host`: one thread answers HELLOs and records NOTIFY
    payloads for every connected sender (selectors; a socketpair wakes it to stop)."""

    def __init__(self, host: str) -> None:
        self._server = socket.create_server((host, 0))
        self._server.setblocking(False)
        self.address = self._server.getsockname()[:2]
        self._wake, self._waker = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._received: list[bytes] = []
        self._session = b""
        self._thread: threading.Thread | None = None

    def start(self, session: str) -> None:
        self._session = session.encode()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="mooncake-notify", daemon=True)
        self._thread.start()

    def take(self) -> list[bytes]:
        with self._lock:
            out, self._received = self._received, []
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._waker.send(b"x")
            self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        for sock in (self._server, self._wake, self._waker):
            sock.close()

    def _run(self) -> None:
        while True:
            for key, events in self._selector.select():
                if key.fileobj is self._wake:
                    return
                if key.fileobj is self._server:
                    self._accept()
                else:
                    self._serve(key.fileobj, key.data, events)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            conn, _ = self._server.accept()
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, _Buffers())

    def _serve(self, conn: socket.socket, buffers: _Buffers, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = conn.recv(65536)
                if not data:
                    raise ConnectionError("sender closed the connection")
                buffers.inbox += data
                self._handle(buffers)
            while buffers.outbox:
                del buffers.outbox[: conn.send(buffers.outbox)]
        except BlockingIOError:
            pass
        except (OSError, ValueError):  # gone, or broke the protocol: drop it
            self._selector.unregister(conn)
            conn.close()
            return
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if buffers.outbox else 0)
        self._selector.modify(conn, wanted, buffers)

    def _handle(self, buffers: _Buffers) -> None:
        """Answers every complete frame in the inbox."""
        while len(buffers.inbox) >= REQUEST.size:
            kind, frame_id, size = REQUEST.unpack_from(buffers.inbox)
            if kind not in (HELLO, NOTIFY) or size > MAX_NOTIFY:
                raise ValueError(f"bad frame (kind {kind}, {size} bytes)")
            end = REQUEST.size + size
            if len(buffers.inbox) < end:
                return
            payload = bytes(buffers.inbox[REQUEST.size : end])
            del buffers.inbox[:end]
            if kind == NOTIFY:
                with self._lock:
                    self._received.append(payload)
            buffers.outbox += REPLY.pack(frame_id, kind == NOTIFY or payload == self._session)


class _Buffers:
    def __init__(self) -> None:
        self.inbox = bytearray()
        self.outbox = bytearray()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise ConnectionError("peer closed the connection")
        buf += data
    return bytes(buf)
