"""The prefill engine's thread (engine.engine_thread): runs prompts, sends their KV layer by
layer to the decode server named in each request's ticket, and commits.

A job's life: submit() -> queued -> (ticket: Hello once per decode server, connect its
transport) -> prefilled in the engine's next steps, its layers sent as they are computed ->
sampled -> (ticket: writes awaited, then Commit, on a finisher thread so the engine keeps
going) -> its future resolves. The job's blocks are held until its writes have completed.

If the engine raises (a CUDA error, a bug), its state is lost: every job's future fails with a
503 naming the error at once, and so does every later one; `failure` says what happened, and
/health answers 503 until the server is restarted.
"""

from __future__ import annotations

import base64
import contextlib
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.scheduler import StepPlan
from engine.sequence import Sequence, StopConditions
from prefill.publisher import KvPublisher, SendSession
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2
from transport.base import Transport, TransportError

TICKET_KEY = "tandem_ticket"  # base64 of a serialized tandem.v1.Ticket
DECODE_KEY = "decode_address"  # host:port of the decode server's gRPC


class PrefillError(Exception):
    """The request cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KvTransfer:
    ticket: decode_pb2.Ticket
    decode_address: str

    @classmethod
    def parse(cls, params: dict) -> KvTransfer:
        try:
            ticket = decode_pb2.Ticket.FromString(base64.b64decode(params[TICKET_KEY]))
            address = str(params[DECODE_KEY])
        except (KeyError, ValueError, TypeError) as e:
            raise PrefillError(400, f"kv_transfer_params: malformed tandem ticket ({e})") from None
        if not ticket.request_id or not ticket.shards:
            raise PrefillError(400, "kv_transfer_params: ticket has no request id or shards")
        return cls(ticket, address)


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopConditions
    transfer: KvTransfer | None
    future: Future = field(default_factory=Future)
    session: SendSession | None = None
    request_id: str = ""
    seq: Sequence | None = None

    def fail(self, error: PrefillError) -> None:
        """Fails the job's future, unless its caller has given up on it (cancelled it)."""
        with contextlib.suppress(InvalidStateError):
            self.future.set_exception(error)

    def resolve(self, result: Result) -> None:
        with contextlib.suppress(InvalidStateError):
            self.future.set_result(result)


@dataclass(frozen=True)
class Result:
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    kv_transfer_params: dict | None


class DecodeClient:
    """One decode server: its gRPC stub, checked by Hello once, and transport peers."""

    def __init__(self, address: str, sender_layout: layout_pb2.LayoutDescriptor) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        try:
            self.stub.Hello(
                decode_pb2.HelloRequest(sender_layout=sender_layout, sender_id="prefill"),
                timeout=10,
            )
        except grpc.RpcError as e:
            self.channel.close()
            raise PrefillError(502, f"decode server {address}: {e.details()}") from None


class PrefillWorker(EngineThread):
    def __init__(
        self,
        engine: LLMEngine,
        publisher: KvPublisher,
        agent: Transport,
        sender_layout: layout_pb2.LayoutDescriptor,
        transfer_timeout_s: float = 30.0,
        layerwise: bool = True,
    ) -> None:
        self.publisher = publisher
        self.agent = agent
        self.sender_layout = sender_layout
        self.transfer_timeout_s = transfer_timeout_s
        self.layerwise = layerwise
        """False: send a request's layers only after its whole forward (to measure what sending
        each layer as it is computed buys)."""
        self._live: dict[str, Job] = {}
        self._after_forward: list[SendSession] = []
        self._decoders: dict[str, DecodeClient] = {}
        self._peers: dict[bytes, object] = {}
        self._finisher = ThreadPoolExecutor(4, thread_name_prefix="prefill-commit")
        self._ids = iter(range(1, 1 << 62))
        super().__init__(engine, server="prefill", thread_name="prefill-engine")

    def submit(self, job: Job) -> Future:
        self._put(job)
        return job.future

    def stop(self) -> None:
        super().stop()
        self._finisher.shutdown(wait=True)
        for client in self._decoders.values():
            client.channel.close()

    def _admit(self, job: Job) -> None:
        job.request_id = f"p{next(self._ids)}"
        try:
            if job.transfer is not None:
                job.session = self._session(job.transfer)
            seq = self.engine.add_request(job.request_id, job.prompt_ids, job.sampling, job.stop)
        except PrefillError as e:
            job.fail(e)
            return
        except TransportError as e:
            job.fail(PrefillError(502, f"KV transport: {e}"))
            return
        except ValueError as e:
            job.fail(PrefillError(400, str(e)))
            return
        job.seq = seq
        self._live[job.request_id] = job

    def _step(self) -> None:
        outputs = self.engine.step(before_run=self._arm)
        for session in self._after_forward:
            for layer in range(len(self.engine.kv_cache.kv_caches)):
                session.layer_ready(layer)
        self.publisher.armed = self._after_forward = []
        for out in outputs:
            job = self._live.get(out.seq_id)
            if job is not None and out.finish_reason is not None:
                del self._live[out.seq_id]
                self._finisher.submit(self._finish, job, out.finish_reason.value)

    def _fail_live(self, failure: str) -> None:
        for job in self._live.values():
            job.fail(PrefillError(503, failure))
        self._live.clear()

    def _refuse(self, job: Job, failure: str) -> None:
        job.fail(PrefillError(503, failure))

    def _session(self, transfer: KvTransfer) -> SendSession:
        client = self._decoders.get(transfer.decode_address)
        if client is None:
            client = DecodeClient(transfer.decode_address, self.sender_layout)
            self._decoders[transfer.decode_address] = client
        endpoint = transfer.ticket.shards[0].endpoint.metadata
        deadline = time.monotonic() + self.transfer_timeout_s
        peer = self._peers.get(endpoint)
        if peer is None or not peer.usable():  # e.g. a TCP connection that broke: reconnect
            self._peers[endpoint] = self.agent.connect(endpoint, deadline)
        return SendSession(
            transfer.ticket, self.agent, self._peers[endpoint], self.engine.kv_cache, deadline
        )

    def _arm(self, plan: StepPlan) -> None:
        """Before a forward: the sessions of prompts that complete in it send each layer."""
        armed = []
        for item in plan.scheduled:
            job = self._live.get(item.seq.seq_id)
            session = job.session if job is not None else None
            if session is not None and item.samples and not session.src_blocks:
                session.src_blocks = list(item.seq.block_ids)
                # Held until the writes complete: the engine frees them when it finishes the
                # sequence, right after this step.
                self.engine.pool.incref(session.src_blocks)
                armed.append(session)
        if self.layerwise:
            self.publisher.armed = armed
        else:
            self._after_forward = armed

    def _finish(self, job: Job, finish_reason: str) -> None:
        seq = job.seq
        kv_params = None
        if job.session is not None:
            finishing = time.monotonic()
            stats = job.session.finish()
            committing = time.monotonic()
            self.engine.pool.free(job.session.src_blocks)
            ticket = job.transfer.ticket
            client = self._decoders[job.transfer.decode_address]
            try:
                client.stub.Commit(
                    decode_pb2.CommitRequest(
                        request_id=ticket.request_id,
                        generation=ticket.generation,
                        sender_rank=0,
                        bytes_written=stats.bytes_written,
                        layers_written=stats.layers,
                        error=stats.error,
                    ),
                    timeout=10,
                )
            except grpc.RpcError as e:
                job.fail(PrefillError(502, f"commit refused: {e.details()}"))
                return
            if stats.error:
                job.fail(PrefillError(502, f"KV transfer failed: {stats.error}"))
                return
            kv_params = {
                "first_token_id": seq.output_ids[0],
                "bytes_written": stats.bytes_written,
                "layers": stats.layers,
                "transfer_ms": round(stats.seconds * 1000, 3),
                # After the forward: waiting for the last writes to land, then the Commit RPC.
                "send_wait_ms": round((committing - finishing) * 1000, 3),
                "commit_ms": round((time.monotonic() - committing) * 1000, 3),
                "prepare_ms": round(stats.prepare_seconds * 1000, 3),
                "post_ms": round(stats.post_seconds * 1000, 3),
                "write_ops": stats.write_ops,
            }
        job.resolve(Result(seq.output_ids, finish_reason, seq.num_prompt_tokens, kv_params))
