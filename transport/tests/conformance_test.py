"""One conformance suite for every transport backend, sender here, receiver in another process
(transport/tests/peer.py). Bytes are verified by CRC-32 of the receiver's memory."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest

import transport
from transport.base import (
    DeadlineExceeded,
    HandshakeError,
    TransferError,
    TransferState,
    WriteOp,
)
from transport.memory import HostBuffer

BACKENDS = os.environ.get("TANDEM_TRANSPORTS", "tcp,shm").split(",")
PEER_BYTES = 256 * 1024 * 1024
MiB = 1024 * 1024


class PeerProcess:
    """The receiver: a child process holding a registered, zeroed buffer."""

    def __init__(self, backend: str, nbytes: int = PEER_BYTES) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transport.tests.peer", backend, str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        self.endpoint = hello["endpoint"].encode()
        self.addr = hello["addr"]

    def crc(self, offset: int, nbytes: int) -> int:
        return self._ask({"cmd": "crc", "offset": offset, "nbytes": nbytes})["crc"]

    def notifications(self) -> list[bytes]:
        return [bytes.fromhex(n) for n in self._ask({"cmd": "notifications"})["notifications"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            # A peer killed by the test may still look alive for a moment.
            with contextlib.suppress(BrokenPipeError, ValueError, RuntimeError):
                self._ask({"cmd": "exit"})
        self.proc.wait(timeout=10)

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.poll()}")
        return json.loads(line)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture()
def peer(backend):
    proc = PeerProcess(backend)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def source():
    """Random bytes to send, filled once for the whole module."""
    buffer = HostBuffer(PEER_BYTES)
    rng = random.Random(7)
    for start in range(0, PEER_BYTES, 16 * MiB):
        buffer.view()[start : start + 16 * MiB] = rng.randbytes(16 * MiB)
    yield buffer
    buffer.close()


@pytest.fixture()
def sender(backend, source):
    agent = transport.create(backend)
    agent.register(source.addr, source.nbytes)
    yield agent, source
    agent.close()


def _deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


@pytest.mark.parametrize("nbytes", [4096, MiB, 64 * MiB, 256 * MiB])
def test_single_write_lands_intact(sender, peer, nbytes):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    agent.write(remote, [WriteOp(buffer.addr, peer.addr, nbytes)], _deadline()).wait()
    assert peer.crc(0, nbytes) == zlib.crc32(buffer.view()[:nbytes])


def test_a_connection_idle_past_the_last_deadline_still_writes(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    agent.write(remote, [WriteOp(buffer.addr, peer.addr, MiB)], _deadline(0.5)).wait()
    time.sleep(1.0)  # longer than that write's deadline: an idle connection is not a dead one
    agent.write(remote, [WriteOp(buffer.addr + MiB, peer.addr, MiB)], _deadline()).wait()
    assert peer.crc(0, MiB) == zlib.crc32(buffer.view()[MiB : 2 * MiB])


def test_thousands_of_small_descriptors_land_intact(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    rng = random.Random(3)
    # 4096 runs of 1-16 KiB from shuffled sources to shuffled, non-overlapping destinations.
    slots = rng.sample(range(PEER_BYTES // (16 * 1024)), 4096)
    ops, expected = [], bytearray(PEER_BYTES)
    for i, slot in enumerate(slots):
        n = rng.randrange(1, 17) * 1024
        src, dst = i * 16 * 1024, slot * 16 * 1024
        ops.append(WriteOp(buffer.addr + src, peer.addr + dst, n))
        expected[dst : dst + n] = buffer.view()[src : src + n]
    agent.write(remote, ops, _deadline()).wait()
    assert peer.crc(0, PEER_BYTES) == zlib.crc32(expected)


def test_write_outside_registered_regions_is_refused_before_any_byte_lands(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    ops = [
        WriteOp(buffer.addr, peer.addr, 4096),  # valid, and first: must not land either
        WriteOp(buffer.addr, peer.addr + PEER_BYTES - 100, 4096),  # runs past the end
    ]
    with pytest.raises(TransferError, match="outside"):
        agent.write(remote, ops, _deadline())
    assert peer.crc(0, 8192) == zlib.crc32(bytes(8192))


def test_zero_length_writes_complete_and_change_nothing(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    agent.write(remote, [], _deadline()).wait()
    agent.write(remote, [WriteOp(buffer.addr, peer.addr, 0)] * 3, _deadline()).wait()
    assert peer.crc(0, 4096) == zlib.crc32(bytes(4096))


def test_writes_that_cannot_start_settle_before_any_io(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    op = WriteOp(buffer.addr, peer.addr, 4096)
    past = time.monotonic() - 1
    assert agent.write(remote, [], past).poll() is TransferState.DONE  # nothing to do
    late = agent.write(remote, [op], past)
    assert late.poll() is TransferState.FAILED
    assert isinstance(late.error(), DeadlineExceeded)
    with pytest.raises(TransferError, match="not registered here"):
        agent.write(remote, [WriteOp(buffer.addr + PEER_BYTES, peer.addr, 4096)], _deadline())
    agent.close()
    closed = agent.write(remote, [op], _deadline())
    assert closed.poll() is TransferState.FAILED
    assert isinstance(closed.error(), TransferError)
    assert peer.crc(0, 4096) == zlib.crc32(bytes(4096))


def test_notification_arrives_after_the_bytes(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    transfer = agent.write(
        remote, [WriteOp(buffer.addr, peer.addr, MiB)], _deadline(), notify=b"req-7:done"
    )
    transfer.wait()
    assert transfer.poll() is TransferState.DONE
    deadline = time.monotonic() + 5
    while not (notes := peer.notifications()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert notes == [b"req-7:done"]
    assert peer.crc(0, MiB) == zlib.crc32(buffer.view()[:MiB])


def test_peer_killed_mid_transfer_fails_within_a_second(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    killed_at = []

    def kill() -> None:
        time.sleep(0.05)
        killed_at.append(time.monotonic())
        os.kill(peer.proc.pid, signal.SIGKILL)

    threading.Thread(target=kill).start()
    op = WriteOp(buffer.addr, peer.addr, 64 * MiB)
    with pytest.raises(TransferError):  # not DeadlineExceeded: the peer is gone, not slow
        for _ in range(10_000):
            agent.write(remote, [op], _deadline()).wait()
    assert killed_at and time.monotonic() - killed_at[0] < 1.0
    if agent.name == "tcp":
        assert not remote.usable()  # its owner connects again instead of failing forever


def test_stopped_peer_gives_deadline_exceeded_at_the_deadline_not_a_hang(sender, peer):
    agent, buffer = sender
    remote = agent.connect(peer.endpoint, _deadline())
    os.kill(peer.proc.pid, signal.SIGSTOP)
    # A one-sided write is the transport copying into the peer's memory, which a stopped peer
    # does not stop (NIXL copies inside the post): 16 MiB, so that the bound is about the
    # deadline and not about faulting in 256 MiB of the peer's pages on a loaded machine.
    nbytes = 16 * MiB if agent.one_sided else PEER_BYTES
    try:
        start = time.monotonic()
        transfer = agent.write(
            remote, [WriteOp(buffer.addr, peer.addr, nbytes)], start + 1.0, notify=b"x"
        )
        if agent.one_sided:  # needs nothing of the peer: may finish, but within the deadline
            with contextlib.suppress(DeadlineExceeded):
                transfer.wait()
        else:
            with pytest.raises(DeadlineExceeded):
                transfer.wait()
            assert time.monotonic() - start > 0.9
        assert time.monotonic() - start < 1.5
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)


def test_bad_endpoints_fail_the_handshake(sender, backend):
    agent, _ = sender
    for malformed in (b"not json", b"[1]", b'{"transport": "%s"}' % backend.encode()):
        with pytest.raises(HandshakeError):
            agent.connect(malformed, _deadline())
    other = "shm" if backend != "shm" else "tcp"
    with pytest.raises(HandshakeError):
        agent.connect(json.dumps({"transport": other}).encode(), _deadline())


def test_reregistration_and_close_leave_nothing_behind(backend, peer):
    threads_before = threading.active_count()
    buffer = HostBuffer(MiB)
    agent = transport.create(backend)
    region = agent.register(buffer.addr, buffer.nbytes)
    agent.deregister(region)
    agent.register(buffer.addr, buffer.nbytes)
    remote = agent.connect(peer.endpoint, _deadline())
    agent.write(remote, [WriteOp(buffer.addr, peer.addr, MiB)], _deadline()).wait()
    endpoint = agent.endpoint()
    agent.close()
    agent.close()  # idempotent
    buffer.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == threads_before
    # Nothing listens any more on what the endpoint advertised.
    other = transport.create(backend)
    try:
        with pytest.raises((HandshakeError, TransferError)):
            stale = other.connect(endpoint, _deadline(2))
            other.write(stale, [], _deadline(2), notify=b"anyone there?").wait()
    finally:
        other.close()
