"""Socket helpers of the code that speaks TCP itself: the tcp backend and Mooncake's side
channel."""

from __future__ import annotations

import contextlib
import socket

from transport.base import DeadlineExceeded, HandshakeError, remaining


def dial(backend: str, address: tuple[str, int], deadline: float) -> socket.socket:
    """A TCP connection to `address`, with Nagle off (frames are small and awaited): raises
    DeadlineExceeded if it is not made by the deadline, HandshakeError if it cannot be made."""
    try:
        sock = socket.create_connection(address, timeout=max(remaining(deadline), 0.001))
    except TimeoutError:
        raise DeadlineExceeded(f"{backend}: connect to {address} timed out") from None
    except OSError as e:
        raise HandshakeError(f"{backend}: cannot connect to {address}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def shutdown(sock: socket.socket) -> None:
    """Shuts both directions down, which wakes a thread blocked on the socket, then closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
