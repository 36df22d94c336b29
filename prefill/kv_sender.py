"""The one KV send path, for tandem's prefill engine and the vLLM connector alike: a request's
KV, in writes the engine hands over as its layers are computed, goes one-sided into the decode
server's blocks named by the request's ticket, and is committed.

A session's life (send_session.SessionState), one per ticket:
  open(transfer) -> CONNECTING: on the connect pool, Hello with the decode server (once per
    server; the decode server compares layouts and refuses a mismatch by name) and a transport
    connect to each shard's endpoint (peers cached, reconnected once no longer usable). A
    failure is cached for `retry_after_s`: later tickets for that server fail at once.
  -> SENDING: the poster thread posts writes in the order they were handed over (those handed
    over while connecting wait for the connect, then go in order)
  -> finish(): once the poster has posted the session's last write, a committer waits for every
    write and sends Commit(bytes, layers), or Commit(error); its Future gives the SendStats. A
    successful commit goes as a transport notification where the ticket takes one
    (Ticket.commit_by_notification), so the prefill's reply does not wait on an RPC.
  Any failure (Hello refused, a bad ticket, a transport error, the deadline) -> FAILED: nothing
  more is written and the commit carries the reason, so the decode server fails the ticket at
  once instead of at its deadline (no commit when the server could not be reached at all).

NOTE: every write is posted before the session's deadline and carries it to the transport,
which ends the write by then. That deadline is the ticket's, shortened by the sender's own
timeout, never lengthened: the decode server hands a failed ticket's blocks to other requests
soon after the ticket's deadline, and a write landing later would corrupt their KV.

Threads: the engine thread calls open/post/finish/abandon and never waits on the network; the
connect pool does Hello and connect; the poster thread alone posts writes; committers wait for
writes and commit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from prefill.kv_writes import BlockLayout, valid_bytes
from prefill.send_session import (
    BuildOps,
    Finish,
    Post,
    Resume,
    SendSession,
    SendStats,
    SessionState,
    Target,
    joins,
)
from prefill.ticket import (
    KvTransfer,
    SpeculativeKv,
    commit_notice,
    kv_planes,
    ticket_problem,
)
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2
from rpc import keepalive
from transport.base import Peer, Transport, TransportError

HELLO_TIMEOUT_S = 5.0
COMMIT_TIMEOUT_S = 10.0
DEADLINE_PASSED = "the ticket's deadline passed before its KV was written"
_log = logging.getLogger(__name__)


def kv_written() -> torch.cuda.Event:
    """For post(ready=...) on CUDA: an event after the kernels queued so far on the current
    stream. A blocking one: the poster sleeps until the device gets there instead of spinning
    in the CUDA driver beside the engine thread's launches (measured on one H100, a 1k-token
    prompt of the Llama-3-8B shape, each of 32 layers posted as it was written: the forward
    took 31.7 ms alone and 77.2 ms beside a spinning poster; with the prefill's events blocking,
    another server start, 36.5 and 49.1 ms)."""
    event = torch.cuda.Event(blocking=True)
    event.record()
    return event


class _Decode:
    """One decode server: its gRPC channel and the cached outcome of this sender's Hello."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=keepalive.CHANNEL_OPTIONS)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.hello: Future | None = None
        """Resolves to "" (accepted) or why not; replaced once a failure is `retry_at` old."""
        self.retry_at = 0.0
        self.unreachable = False
        """The last Hello found no server answering (not a refusal)."""
        self.instance_id = ""
        """The server process the Hello went to, as its tickets name it."""
        self.endpoints: set[bytes] = set()
        """Its transport endpoints this sender connected to (dropped when it restarts)."""
        self.retired: set[str] = set()
        """Instance ids it had before restarts: a late ticket of one fails at once."""


class KvSender:
    """Sends tickets' KV from one engine (one tensor-parallel rank) with one transport agent."""

    def __init__(
        self,
        agent: Transport,
        layout: layout_pb2.LayoutDescriptor,
        *,
        sender_id: str,
        rank: int,
        heads: range,
        token_bytes: int,
        timeout_s: float,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """layout: this engine's descriptor (sent in Hello); its kv_format says whether a layer
        is K and V or one latent plane, its speculative_kv what the proposer's layers after the
        model's hold. heads: the model's KV heads this rank holds (the one head of a latent).
        token_bytes: one token of one head (head_dim x element size)."""
        self.agent = agent
        self.layout = layout
        self.speculative = SpeculativeKv.parse(layout.speculative_kv)
        self.sender_id = sender_id
        self.rank = rank
        self.heads = heads
        self.token_bytes = token_bytes
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._decoders: dict[str, _Decode] = {}
        self._peers: dict[bytes, Peer] = {}
        self._peer_failures: dict[bytes, tuple[float, str]] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._connector = ThreadPoolExecutor(8, thread_name_prefix="kv-connect")
        self._committer = ThreadPoolExecutor(4, thread_name_prefix="kv-commit")
        self._poster = threading.Thread(target=self._post_loop, name="kv-post", daemon=True)
        self._poster.start()

    # -- the engine thread's calls: none of them waits on the network ----------------------

    def open(self, transfer: KvTransfer, error: str = "") -> SendSession:
        """A session for `transfer`; connecting goes on in the background. `error`: the
        adapter already knows it cannot send (the session fails and commits that)."""
        ticket, now = transfer.ticket, self.clock()
        session = SendSession(transfer, transfer.deadline(self.timeout_s, lambda: now))
        session.dst_layout = BlockLayout(
            ticket.layout.block_size, ticket.block_stride_bytes, ticket.head_stride_bytes,
            self.token_bytes,
        )  # fmt: skip
        if self.speculative is not None:
            session.proposer_dst_layout = BlockLayout(
                ticket.layout.block_size, ticket.speculative_block_stride_bytes,
                ticket.speculative_head_stride_bytes, self.speculative.token_bytes,
            )  # fmt: skip
        if not error and session.deadline <= now:
            error = DEADLINE_PASSED
        with self._lock:
            decode = self._decoders.get(transfer.decode_address)
            if decode is None:
                decode = self._decoders[transfer.decode_address] = _Decode(transfer.decode_address)
            if ticket.decode_instance_id in decode.retired:  # issued before its restart
                error = error or (
                    f"decode server {transfer.decode_address} restarted since it issued this ticket"
                )
            elif ticket.decode_instance_id != decode.instance_id:
                self._restarted_locked(decode, ticket.decode_instance_id)
            if error:
                session._unreachable = decode.unreachable  # a commit could only hang there
                self._settle(session, SessionState.FAILED, error)
                return session
            hello = decode.hello
            if hello is None or (hello.done() and hello.result() and now >= decode.retry_at):
                hello = decode.hello = self._connector.submit(self._say_hello, decode)
        hello.add_done_callback(
            lambda done: self._connector.submit(self._connect, session, decode, done.result())
        )
        return session

    def post(
        self,
        session: SendSession,
        build: BuildOps,
        ready: object | None = None,
        completes_layer: int | None = None,
    ) -> Future:
        """Queues one post of writes (`build` is called per target); `completes_layer`: the
        layer whose last tokens these writes carry. The Future resolves, once posted or
        skipped, with the list of Transfers (wait on them to know the writes ended)."""
        future: Future = Future()
        self._queue.put(Post(session, build, ready, completes_layer, future))
        return future

    def finish(self, session: SendSession) -> Future:
        """After the session's last post: the Future resolves with SendStats once it is
        committed (or its failure is)."""
        future: Future = Future()
        self._queue.put(Finish(session, future))
        return future

    def fail(self, session: SendSession, reason: str) -> None:
        """Fails a session (its request ended, or cannot wait for its connect): nothing more
        is written; what waited for its connect is let go."""
        with self._lock:
            if session.state is SessionState.FAILED:
                return
            connecting = session.state is SessionState.CONNECTING
            self._settle(session, SessionState.FAILED, reason)
        if connecting:
            self._queue.put(Resume(session))

    def close(self) -> None:
        self._queue.put(None)
        self._poster.join(timeout=30)
        self._connector.shutdown(wait=False, cancel_futures=True)
        self._committer.shutdown(wait=True)
        for decode in self._decoders.values():
            decode.channel.close()

    def _restarted_locked(self, decode: _Decode, instance_id: str) -> None:
        """Another server process answers at the decode's address (a restart, or the first
        ticket): what was learned of the old one, its Hello's outcome and transport peers, is
        dropped, so the new one is asked again and connected to afresh."""
        if decode.instance_id:
            decode.retired.add(decode.instance_id)
        decode.instance_id = instance_id
        decode.hello, decode.retry_at, decode.unreachable = None, 0.0, False
        for endpoint in decode.endpoints:
            self._peers.pop(endpoint, None)
            self._peer_failures.pop(endpoint, None)
        decode.endpoints.clear()

    # -- connect pool -------------------------------------------------------------------------

    def _say_hello(self, decode: _Decode) -> str:
        request = decode_pb2.HelloRequest(sender_layout=self.layout, sender_id=self.sender_id)
        try:
            decode.stub.Hello(request, timeout=HELLO_TIMEOUT_S)
        except grpc.RpcError as e:
            decode.retry_at = self.clock() + self.retry_after_s
            decode.unreachable = e.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            return f"decode server {decode.address}: {e.details()}"
        decode.unreachable = False
        return ""

    def _connect(self, session: SendSession, decode: _Decode, refusal: str) -> None:
        session._unreachable = bool(refusal) and decode.unreachable
        # NOTE: after Hello: a sender of another layout hears the refusal naming both values
        # rather than what that makes wrong in the ticket.
        problem = ticket_problem(session.ticket, self.layout.model.num_layers, self.token_bytes)
        targets = refusal or problem or self._targets(session)
        with self._lock:
            if session.state is not SessionState.CONNECTING:
                return  # failed meanwhile: its Resume is queued already
            if isinstance(targets, str):
                self._settle(session, SessionState.FAILED, targets)
            else:
                session.targets = targets
                self._settle(session, SessionState.SENDING)
        self._queue.put(Resume(session))

    def _targets(self, session: SendSession) -> list[Target] | str:
        """The shards holding this sender's heads, each with a connected peer; or why not."""
        mine, targets = self.heads, []
        for shard in session.ticket.shards:
            first, end = max(mine.start, shard.heads.start), min(mine.stop, shard.heads.end)
            if first >= end:
                continue
            peer = self._peer(shard.endpoint.metadata, session.deadline)
            with self._lock:
                self._decoders[session.transfer.decode_address].endpoints.add(
                    shard.endpoint.metadata
                )
            if isinstance(peer, str):
                return peer
            local = range(first - mine.start, end - mine.start)
            targets.append(Target(shard, peer, local, shard.heads.start - mine.start))
        return targets

    def _peer(self, endpoint: bytes, deadline: float) -> Peer | str:
        with self._lock:
            peer = self._peers.get(endpoint)
            failed = self._peer_failures.get(endpoint)
        if peer is not None and peer.usable():
            return peer
        if failed is not None and self.clock() < failed[0]:
            return failed[1]
        try:  # e.g. a TCP connection that broke: connect again
            peer = self.agent.connect(endpoint, deadline)
        except TransportError as e:
            reason = f"KV transport: {e}"
            with self._lock:
                self._peer_failures[endpoint] = (self.clock() + self.retry_after_s, reason)
            return reason
        with self._lock:
            self._peers[endpoint] = peer
            self._peer_failures.pop(endpoint, None)
        return peer

    # -- the poster thread --------------------------------------------------------------------

    def _post_loop(self) -> None:
        held = []  # an item taken from the queue while batching, handled next
        while (item := held.pop() if held else self._queue.get()) is not None:
            session = item.session
            if isinstance(item, Resume):
                deferred, session._deferred = session._deferred, []
                for post in deferred:
                    self._post([post])
                if session._finish is not None:
                    self._committer.submit(self._commit, session, session._finish)
                    session._finish = None
            elif session.state is SessionState.CONNECTING or session._deferred:
                if isinstance(item, Finish):
                    session._finish, session._finish_called = item.future, self.clock()
                else:
                    session._deferred.append(item)
            elif isinstance(item, Finish):
                session._finish_called = self.clock()
                self._committer.submit(self._commit, session, item.future)
            else:
                batch = [item]
                while not held:
                    try:
                        following = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    (batch if joins(batch[0], following) else held).append(following)
                self._post(batch)

    def _post(self, batch: list[Post]) -> None:
        """Posts one session's writes of `batch` as one write per target: a poster that fell
        behind the forward (short layers) catches up in fewer, larger posts."""
        session, transfers = batch[0].session, []
        if session.state is SessionState.SENDING:
            if batch[-1].ready is not None:  # one stream: the last event implies the others
                batch[-1].ready.synchronize()
            if self.clock() >= session.deadline:
                self.fail(session, DEADLINE_PASSED)
            if session._started is None:
                session._started = self.clock()
            try:
                for target in session.targets if session.state is SessionState.SENDING else ():
                    preparing = time.monotonic()
                    ops = [op for item in batch for op in item.build(target)]
                    posting = time.monotonic()
                    transfers.append(self.agent.write(target.peer, ops, session.deadline))
                    session._prepare += posting - preparing
                    session._post += time.monotonic() - posting
                    session._ops += len(ops)
                    session._posts += 1
            except TransportError as e:
                self.fail(session, f"KV transport: {e}")
            except Exception as e:
                # An adapter's writes that cannot be built fail their session alone: the poster
                # serves every session, and were it to die they would all wait out deadlines.
                _log.exception("KV send: building the writes of %s", session.ticket.request_id)
                self.fail(session, f"KV send: cannot build the writes: {type(e).__name__}: {e}")
            if session.state is SessionState.SENDING:
                layers = (item.completes_layer for item in batch)
                session._layers_done.update(layer for layer in layers if layer is not None)
        session._transfers += transfers
        for item in batch:
            item.future.set_result(transfers)

    def _notify_commit(self, session: SendSession, request: decode_pb2.CommitRequest) -> bool:
        """Sends a commit as a notification to rank 0's transport agent, where the ticket takes
        one and this sender writes there (it has a peer); whether it was sent. A sender that
        cannot falls back to the RPC, which the decode server takes as a repeat if both came."""
        if not session.ticket.commit_by_notification:
            return False
        peer = next((t.peer for t in session.targets if t.shard.rank == 0), None)
        if peer is None:
            return False
        try:
            self.agent.write(peer, [], session.deadline, notify=commit_notice(request)).wait()
        except TransportError as e:
            _log.warning("KV send: commit notification of %s failed (%s): calling Commit",
                         request.request_id, e)  # fmt: skip
            return False
        return True

    def _valid_bytes(self, session: SendSession, layers: int) -> int:
        """The bytes in `layers` layers sent of the prompt's tokens the decode server has not
        cached: the model's, then the proposer's."""
        model_layers = min(layers, self.layout.model.num_layers)
        heads = sum(len(t.heads) for t in session.targets)
        planes = kv_planes(self.layout.model)
        num_tokens = session.ticket.num_tokens - session.ticket.num_cached_tokens
        nbytes = valid_bytes(num_tokens, heads, self.token_bytes, model_layers, planes)
        spec = self.speculative
        if layers > model_layers and session.writes_proposer:
            extra = layers - model_layers
            nbytes += valid_bytes(num_tokens, spec.num_heads, spec.token_bytes, extra, spec.planes)
        return nbytes

    @staticmethod
    def _settle(session: SendSession, state: SessionState, error: str = "") -> None:
        """Under the lock."""
        session.state, session.error = state, session.error or error
        session.connected.set()

    # -- committers ---------------------------------------------------------------------------

    def _commit(self, session: SendSession, future: Future) -> None:
        for transfer in session._transfers:
            try:
                transfer.wait()
            except TransportError as e:
                self.fail(session, f"KV transport: {e}")
        written = self.clock()
        ticket, error = session.ticket, session.error
        layers = 0 if error else len(session._layers_done)
        nbytes = self._valid_bytes(session, layers)
        if not session._unreachable:
            request = decode_pb2.CommitRequest(
                request_id=ticket.request_id, generation=ticket.generation,
                sender_rank=self.rank, bytes_written=nbytes, layers_written=layers, error=error,
                num_senders=self.layout.tp_size,
            )  # fmt: skip
            with self._lock:
                decode = self._decoders[session.transfer.decode_address]
            try:
                if error or not self._notify_commit(session, request):
                    decode.stub.Commit(request, timeout=COMMIT_TIMEOUT_S)
            except grpc.RpcError as e:
                error = error or f"commit refused: {e.details()}"
        future.set_result(
            SendStats(
                bytes_written=nbytes,
                layers=layers,
                seconds=written - (session._started or written),
                error=error,
                prepare_seconds=session._prepare,
                post_seconds=session._post,
                write_ops=session._ops,
                posts=session._posts,
                wait_seconds=written - (session._finish_called or written),
                commit_seconds=self.clock() - written,
            )
        )
