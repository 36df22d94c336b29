"""Mooncake Transfer Engine transport: writes go through Mooncake (`mooncake.engine`, P2P
handshake, no metadata server); notifications and liveness go through a small side channel.

Life of a transfer:
  receiver: MooncakeTransport(host) -> register(...) -> endpoint(): JSON with the Mooncake
            session name "host:rpc_port", the side channel's (host, port), the protocol and
            the registered regions.
  sender:   connect(endpoint, deadline): HELLO on the peer's side channel, answered by its
            listener thread (proves, within the deadline, that the peer runs and owns that
            session), then Mooncake's handshake (get_first_buffer_address), which caches the
            peer's segment so later writes do no blocking RPC.
            write(peer, ops, deadline, notify): ops are checked against the peer's and our own
            regions before any I/O; each non-empty op becomes one transfer_submit_write, at most
            _WINDOW in flight per peer session (Mooncake's per-peer TCP queue fails requests
            beyond about 2,000). poll() is non-blocking: it reaps runs with
            transfer_check_status, submits more, and once every run landed sends the NOTIFY frame
            and waits for its ACK. Past the deadline: DeadlineExceeded.
  receiver: notifications() returns NOTIFY payloads, recorded by the listener thread.

Why this API: batch_transfer_async_write's only status call, get_batch_transfer_status, spins
until the whole batch ends or Mooncake's own timeout (MC_TRANSFER_TIMEOUT, at least 5 s, plus
1 ns per byte), and transfer_check_status on a batch inspects only its first task; one batch per
run keeps poll() non-blocking and the deadline ours. Mooncake's notifications (TransferNotify)
ride only on the blocking transfer_sync calls and on its handshake RPC, so they have no deadline
either: hence the side channel (frames as in transport/tcp: request kind, id, length, payload;
reply id, ok).

Completion and failure. Over TCP a run is done when the peer's Mooncake I/O thread has applied
the last byte and acknowledged it (Mooncake's v2 framing; MC_TCP_PROTO=1, the unacknowledged
framing, is refused because a notification could then overtake its bytes): the peer's process
receives the data, so one_sided is False and a stopped peer gives DeadlineExceeded. Over RDMA the
NIC writes without the peer's CPU: one_sided is True, and only a notification waits for the peer
(RDMA is untested: no HCA on the dev machines).
A killed peer resets Mooncake's connection (the run fails within milliseconds) and closes the
side channel, which every poll() checks, so the transfer fails with TransferError at once.
NOTE: Mooncake cannot cancel a run. After DeadlineExceeded or abort() a run still in flight keeps
reading our source and writing the peer's memory until it ends, or until Mooncake drops it after
MC_TCP_PROGRESS_TIMEOUT_SEC (default 30 s) without progress, or until close(). Its batch is kept
and reaped by later polls.

Protocol. Mooncake does not choose its transport by its `protocol` argument: it installs RDMA
whenever it discovers an HCA (filtered by `device_name`) and TCP otherwise, so protocol="rdma" on
a host without one would silently run over TCP. This backend refuses that at construction, and
for protocol="tcp" passes a device filter that matches no HCA, so TCP is what runs.

Binds (Mooncake 0.3.13.post1, checked with ss): the handshake RPC listens on 0.0.0.0:P and the
TCP data transport on [::]:Q (dual stack, every IPv4 and IPv6 address), P and Q taken from
MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (default 15000-17000), whatever `host` is: `host` is only the
address advertised to peers, and no setting restricts these listeners to it (MC_TCP_BIND_ADDRESS
does not apply in P2P handshake mode). Only the side channel binds `host` itself. Mooncake
accepts writes from anyone who reaches Q into any registered region: firewall those ports or
use a private network.

Threads: one of ours per agent (the side channel's listener), joined by close(). Each engine
has native threads of its own (two after initialize, one more once it has transferred), joined
when close() drops the engine, which takes up to a second (a native loop that wakes once a
second). Importing `mooncake.engine` starts five more native threads for the whole process,
which live as long as it does. None of them are Python threads.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Sequence

from mooncake.engine import SUPPORT_CUDA, TransferEngine

from transport.base import (
    DeadlineExceeded,
    HandshakeError,
    Peer,
    Region,
    RegionTable,
    Transfer,
    TransferError,
    TransferState,
    Transport,
    TransportError,
    WriteOp,
    endpoint_bytes,
    reading_endpoint,
)
from transport.mooncake.side_channel import (
    MAX_NOTIFY,
    NOTIFY,
    REPLY,
    REQUEST,
    NotifyListener,
    hello,
)
from transport.sockets import shutdown

_PROTOCOLS = ("tcp", "rdma")
_RDMA_SYSFS = "/sys/class/infiniband"
_NO_HCA = "tandem-tcp-only"  # a device filter no HCA matches: Mooncake then installs TCP
_WINDOW = 512  # runs in flight per peer session (Mooncake rejects beyond ~2,000)
_SUBMIT_FAILED = (0, 2**64 - 1)  # transfer_submit_write's failures: 0 and (uint64_t)-1


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(
        self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", **options
    ) -> None:
        if options:
            raise ValueError(f"mooncake: unknown options {', '.join(sorted(options))}")
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol: {protocol!r} is not one of {', '.join(_PROTOCOLS)}")
        if protocol == "tcp" and device_name:
            raise ValueError("device_name: names RDMA devices; it needs protocol='rdma'")
        if protocol == "rdma" and not _rdma_devices(device_name):
            wanted = f" named {device_name!r}" if device_name else ""
            raise ValueError(
                f"mooncake: protocol='rdma' was asked for but this host has no RDMA device"
                f"{wanted} ({_RDMA_SYSFS} lists none), and Mooncake would silently run over "
                f"TCP instead: use protocol='tcp', or install and configure an RDMA NIC "
                f"(driver and rdma-core) so that it appears in {_RDMA_SYSFS}"
            )
        # NOTE: Mooncake's own switch, read here only to refuse it: with the legacy framing a
        # write "completes" when it leaves our socket, before it lands.
        if os.environ.get("MC_TCP_PROTO") == "1":
            raise ValueError("mooncake: MC_TCP_PROTO=1 reports writes done before they land")
        self.one_sided = protocol == "rdma"
        self._protocol = protocol
        self._lock = threading.Lock()  # guards the engine calls and everything below
        self._regions = RegionTable("mooncake")
        self._peers: list[_MooncakePeer] = []
        self._inflight: dict[str, int] = {}  # peer session -> runs submitted, not yet reaped
        self._orphans: dict[int, str] = {}  # batch id -> session, of runs nobody waits for
        self._closed = False
        try:
            self._listener = NotifyListener(host)
        except OSError as e:
            raise ValueError(f"host: cannot listen on {host!r}: {e}") from None
        engine = TransferEngine()
        filter_ = device_name if protocol == "rdma" else _NO_HCA
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, filter_)
        if rc != 0:
            self._listener.close()
            raise TransportError(
                f"mooncake: initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}) failed with code "
                f"{rc} (the reason is in Mooncake's log: MC_LOG_LEVEL=INFO)"
            )
        self._engine: TransferEngine | None = engine
        self._session = f"{f'[{host}]' if ':' in host else host}:{engine.get_rpc_port()}"
        self._listener.start(self._session)

    # -- local memory --------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int, device: str = "cpu") -> Region:
        if device != "cpu" and not (device.startswith("cuda:") and SUPPORT_CUDA):
            raise ValueError(
                f"mooncake: cannot register {device} memory with this build (host memory only; "
                f"GPU memory needs the CUDA wheel, mooncake-transfer-engine)"
            )
        region = Region(addr, nbytes, device)
        with self._lock:
            rc = self._live_engine().register_memory(addr, nbytes)
            if rc != 0:
                raise TransportError(f"mooncake: register_memory({addr:#x}, {nbytes}) -> {rc}")
            self._regions.add(region)
        return region

    def deregister(self, region: Region) -> None:
        with self._lock:
            self._regions.remove(region)
            rc = self._live_engine().unregister_memory(region.addr)
            if rc != 0:
                raise TransportError(f"mooncake: unregister_memory({region.addr:#x}) -> {rc}")

    def endpoint(self) -> bytes:
        return endpoint_bytes(
            "mooncake",
            self._regions.pairs(),
            protocol=self._protocol,
            session=self._session,
            notify=list(self._listener.address),
        )

    # -- sending -------------------------------------------------------------------------------

    def connect(self, endpoint: bytes, deadline: float) -> Peer:
        with reading_endpoint("mooncake", endpoint) as info:
            session, protocol = str(info["session"]), str(info["protocol"])
            address = (str(info["notify"][0]), int(info["notify"][1]))
            regions = [Region(int(a), int(n)) for a, n in info["regions"]]
        if protocol != self._protocol:
            raise HandshakeError(f"mooncake: peer {session} speaks {protocol}, we {self._protocol}")
        peer = _MooncakePeer(session, regions, hello(address, session, deadline))
        with self._lock:
            if self._engine is None:
                peer.close()
                raise HandshakeError("mooncake: transport closed")
            # NOTE: a blocking RPC (Mooncake's handshake waited 62 s on a stopped peer); the HELLO
            # has just shown the peer running, so it returns at once. It caches the peer's segment
            # descriptor, so that writes do not need the RPC.
            if regions and self._engine.get_first_buffer_address(session) == 0:
                peer.close()
                raise HandshakeError(f"mooncake: handshake with {session} failed (see its log)")
            self._peers.append(peer)
        return peer

    def _check_local(self, ops: Sequence[WriteOp], notify: bytes) -> None:
        self._regions.check_sources(ops)
        if len(notify) > MAX_NOTIFY:
            raise TransferError(f"mooncake: notify of {len(notify)} bytes (at most {MAX_NOTIFY})")

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float, notify: bytes) -> Transfer:
        assert isinstance(peer, _MooncakePeer)
        transfer = _MooncakeTransfer(self, peer, ops, deadline, notify)
        transfer.poll()  # starts the I/O now
        return transfer

    # -- receiving -----------------------------------------------------------------------------

    def notifications(self) -> list[bytes]:
        return self._listener.take()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
            peers, self._peers = self._peers, []
            self._orphans.clear()
        for peer in peers:
            peer.close()
        self._listener.close()
        # The last reference: Mooncake's destructor cancels what is in flight, joins its two
        # threads and closes its listeners, here.
        del engine

    # -- for _MooncakeTransfer, under self._lock -----------------------------------------------

    def _live_engine(self) -> TransferEngine:
        if self._engine is None:
            raise TransferError("mooncake: transport closed")
        return self._engine

    def _take_slot(self, session: str) -> bool:
        if self._inflight.get(session, 0) >= _WINDOW:
            return False
        self._inflight[session] = self._inflight.get(session, 0) + 1
        return True

    def _free_slot(self, session: str) -> None:
        self._inflight[session] -= 1

    def _abandon(self, batches: Sequence[int], session: str) -> None:
        self._orphans.update(dict.fromkeys(batches, session))

    def _reap_orphans(self, engine: TransferEngine) -> None:
        """Frees the batches of abandoned runs that have ended (transfer_check_status frees a
        batch once it reports it done or failed)."""
        for batch, session in list(self._orphans.items()):
            if engine.transfer_check_status(batch) != 0:
                del self._orphans[batch]
                self._free_slot(session)


class _MooncakeTransfer(Transfer):
    """Runs queued -> submitted (at most _WINDOW per peer) -> landed; then the notification."""

    def __init__(
        self,
        owner: MooncakeTransport,
        peer: _MooncakePeer,
        ops: list[WriteOp],
        deadline: float,
        notify: bytes,
    ) -> None:
        self.deadline = deadline
        self._owner = owner
        self._peer = peer
        self._queue = ops[::-1]  # pop() from the end submits in order
        self._total = len(ops)
        self._submitted: dict[int, WriteOp] = {}  # batch id -> its run
        self._notify = notify
        self._notify_id: int | None = None
        self._state = TransferState.PENDING
        self._error: TransportError | None = None

    def poll(self) -> TransferState:
        with self._owner._lock:
            if self._state is TransferState.PENDING:
                try:
                    self._advance()
                except TransportError as e:
                    self._fail(e)
            return self._state

    def error(self) -> TransportError | None:
        return self._error

    def abort(self) -> None:
        with self._owner._lock:
            if self._state is TransferState.PENDING:
                self._fail(TransferError("mooncake: transfer aborted"))

    def _advance(self) -> None:
        """One step: reaps the runs that ended; then, before the deadline, submits more, and
        once every run has landed sends the notification; DONE once it is acknowledged."""
        engine = self._owner._live_engine()
        self._owner._reap_orphans(engine)
        self._peer.drain()
        session = self._peer.session
        for batch, op in list(self._submitted.items()):
            status = engine.transfer_check_status(batch)
            if status == 0:
                continue
            del self._submitted[batch]
            self._owner._free_slot(session)
            if status != 1:  # -1 failed, -2 timed out
                raise TransferError(
                    f"mooncake: write of {op.nbytes} bytes to {session} {op.dst:#x} failed "
                    f"(transfer_check_status {status}; the reason is in Mooncake's log)"
                )
        landed = not self._queue and not self._submitted
        if landed and (not self._notify or self._peer.acknowledged(self._notify_id)):
            self._state = TransferState.DONE
            return
        if time.monotonic() >= self.deadline:
            left = len(self._queue) + len(self._submitted)
            what = f"{left} of {self._total} writes" if left else "the notification's ack"
            raise DeadlineExceeded(f"mooncake: {what} to {session} not done by the deadline")
        while self._queue and self._owner._take_slot(session):
            op = self._queue.pop()
            batch = engine.transfer_submit_write(session, op.src, op.dst, op.nbytes)
            if batch in _SUBMIT_FAILED:
                self._owner._free_slot(session)
                raise TransferError(
                    f"mooncake: transfer_submit_write of {op.nbytes} bytes to {session} "
                    f"{op.dst:#x} failed ({batch:#x})"
                )
            self._submitted[batch] = op
        if landed and self._notify_id is None:
            self._notify_id = self._peer.notify(self._notify)
            self._peer.drain()

    def _fail(self, error: TransportError) -> None:
        # NOTE: without its traceback, whose frames hold the engine: close() must drop the last
        # reference to it, or Mooncake's threads outlive close() and keep reading our memory.
        self._state, self._error = TransferState.FAILED, error.with_traceback(None)
        self._owner._abandon(list(self._submitted), self._peer.session)
        self._submitted.clear()
        if self._notify_id is not None:
            self._peer.forget(self._notify_id)


class _MooncakePeer(Peer):
    """The peer's Mooncake session plus our side-channel connection to it (non-blocking; read
    and written only by polls, under the transport's lock)."""

    def __init__(self, session: str, regions: list[Region], sock: socket.socket) -> None:
        self.session = session
        self.regions = regions
        self._sock = sock
        self._ids = itertools.count(1)
        self._outbox = bytearray()
        self._inbox = bytearray()
        self._waiting: set[int] = set()
        self._acked: set[int] = set()
        self._broken: TransportError | None = None

    def notify(self, payload: bytes) -> int:
        """Queues a NOTIFY frame (drain() sends it); returns the id its ACK will carry."""
        notify_id = next(self._ids)
        self._outbox += REQUEST.pack(NOTIFY, notify_id, len(payload)) + payload
        self._waiting.add(notify_id)
        return notify_id

    def acknowledged(self, notify_id: int | None) -> bool:
        if notify_id not in self._acked:
            return False
        self._acked.discard(notify_id)
        self._waiting.discard(notify_id)
        return True

    def forget(self, notify_id: int) -> None:
        self._waiting.discard(notify_id)
        self._acked.discard(notify_id)

    def drain(self) -> None:
        """Sends what it can, takes the ACKs that came; raises TransferError once the peer has
        closed the side channel (its process died or closed its transport)."""
        if self._broken:
            raise self._broken
        try:
            while self._outbox:
                del self._outbox[: self._sock.send(self._outbox)]
        except BlockingIOError:
            pass
        except OSError as e:
            self._break(e)
        try:
            while data := self._sock.recv(65536):
                self._inbox += data
            self._break(ConnectionError("closed the connection"))
        except BlockingIOError:
            pass
        except OSError as e:
            self._break(e)
        while len(self._inbox) >= REPLY.size:
            notify_id, _ = REPLY.unpack_from(self._inbox)
            del self._inbox[: REPLY.size]
            if notify_id in self._waiting:
                self._acked.add(notify_id)

    def close(self) -> None:
        self._broken = self._broken or TransferError("mooncake: transport closed")
        shutdown(self._sock)

    def _break(self, error: OSError) -> None:
        self._broken = TransferError(f"mooncake: peer {self.session} is gone: {error}")
        shutdown(self._sock)
        raise self._broken


def _rdma_devices(device_name: str) -> list[str]:
    """RDMA devices on this host (those Mooncake's discovery, ibv_get_device_list, would
    find), restricted to the comma-separated `device_name` filter when one is given."""
    try:
        found = sorted(os.listdir(_RDMA_SYSFS))
    except FileNotFoundError:
        return []
    wanted = [name for name in device_name.split(",") if name]
    return [name for name in found if not wanted or name in wanted]
