"""One request through the disaggregated stack (docs/design.md, steps 2-5):

  pick a decode instance (least outstanding tokens) -> Reserve -> pick a prefill instance (least
  in flight) -> POST /v1/completions with the ticket (on failure: once more, on another prefill)
  -> Generate, streamed back as lists of token ids, then a Finished.

Cancelling the consumer (client gone) aborts the request on the decode server, and so does a
prefill failure (the reservation is released at once instead of at its deadline). A decode
instance whose RPC fails with UNAVAILABLE is marked down until a Stats probe answers; a prefill
instance that cannot be reached or answers 503 (its engine failed) is marked down until its
/health answers 200.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import httpx

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc

PROBE_INTERVAL_S = 2.0

# Idle connections to a prefill server are dropped after 2 s, before the server's own keep-alive
# timeout (5 s in uvicorn, tandem's prefill server and vLLM's alike) can close one as a request
# is sent on it: that race surfaced as a ReadError and a 503 under load.
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=2.0)


class BackendError(Exception):
    """The request could not be served; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PrefillFailed(BackendError):
    """No prefill instance prefilled the request; `ticket_delivered` is False when none even
    accepted the connection (so nothing can be writing into the reserved blocks)."""

    def __init__(self, message: str, ticket_delivered: bool) -> None:
        super().__init__(503, message)
        self.ticket_delivered = ticket_delivered


@dataclass
class PrefillInstance:
    url: str
    client: httpx.AsyncClient
    in_flight: int = 0
    healthy: bool = True


@dataclass
class DecodeInstance:
    address: str
    channel: grpc.aio.Channel
    stub: decode_pb2_grpc.DecodeServiceStub
    outstanding_tokens: int = 0
    healthy: bool = True


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: decode_pb2.SamplingParams
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int


_FINISH = {
    decode_pb2.FINISH_REASON_STOP: "stop",
    decode_pb2.FINISH_REASON_LENGTH: "length",
    decode_pb2.FINISH_REASON_ABORT: "abort",
}


class Orchestrator:
    def __init__(self, prefill_urls: Sequence[str], decode_addresses: Sequence[str]) -> None:
        self.prefill_urls = list(prefill_urls)
        self.decode_addresses = list(decode_addresses)
        self.prefills: list[PrefillInstance] = []
        self.decodes: list[DecodeInstance] = []
        self._ids = itertools.count(1)

    async def start(self) -> None:
        """Opens the clients; on the event loop that serves (gRPC aio channels bind to it)."""
        self.prefills = [
            PrefillInstance(url, httpx.AsyncClient(base_url=url, timeout=600, limits=_LIMITS))
            for url in self.prefill_urls
        ]
        for address in self.decode_addresses:
            channel = grpc.aio.insecure_channel(address)
            self.decodes.append(
                DecodeInstance(address, channel, decode_pb2_grpc.DecodeServiceStub(channel))
            )

    async def generate(
        self, request: GenerationRequest, request_id: str
    ) -> AsyncIterator[list[int] | Finished]:
        decode = self._pick_decode()
        decode.outstanding_tokens += request.max_tokens
        rid = f"{request_id}-{next(self._ids)}"
        started = False
        try:
            ticket = await decode.stub.Reserve(decode_pb2.ReserveRequest(
                request_id=rid, prompt_token_ids=request.prompt_ids, num_senders=1,
                max_tokens=request.max_tokens), timeout=30)  # fmt: skip
            try:
                first = await self._prefill(ticket.ticket, decode.address, request)
            except PrefillFailed as e:
                undelivered = not e.ticket_delivered
                await asyncio.shield(self._abort(decode, rid, "prefill failed", undelivered))
                raise
            stream = decode.stub.Generate(decode_pb2.GenerateRequest(
                request_id=rid, generation=ticket.ticket.generation, first_token_id=first,
                sampling=request.sampling, max_tokens=request.max_tokens,
                min_tokens=request.min_tokens, stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos))  # fmt: skip
            started = True
            async for message in stream:
                if message.token_ids:
                    yield list(message.token_ids)
                if message.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED:
                    yield Finished(
                        _FINISH[message.finish_reason],
                        message.usage.prompt_tokens,
                        message.usage.completion_tokens,
                    )
                    return
            raise BackendError(502, f"decode server {decode.address} ended the stream early")
        except grpc.aio.AioRpcError as e:
            raise self._failed(decode, e) from None
        except (asyncio.CancelledError, GeneratorExit):
            if started:  # the client is gone: stop decoding for it
                await asyncio.shield(self._abort(decode, rid, "client gone"))
            raise
        finally:
            decode.outstanding_tokens -= request.max_tokens

    async def close(self) -> None:
        for prefill in self.prefills:
            await prefill.client.aclose()
        for decode in self.decodes:
            await decode.channel.close()

    async def tokenize(self, body: dict) -> list[int]:
        """Token ids from a prefill instance's /tokenize (`prompt` or `messages`); a failure is
        retried once, on another instance, as the prefill itself is."""
        error = "no prefill instance is available"
        for prefill in self._prefill_order():
            prefill.in_flight += 1
            try:
                reply = await prefill.client.post("/tokenize", json=body)
                if reply.status_code == 200:
                    return reply.json()["tokens"]
                error = f"prefill {prefill.url} /tokenize: {reply.status_code} {reply.text[:200]}"
                if reply.status_code == 503:  # its engine failed: down until /health says 200
                    prefill.healthy = False
                if reply.status_code < 500:  # the request is at fault: another would refuse it too
                    raise BackendError(reply.status_code, error)
            except httpx.HTTPError as e:
                prefill.healthy = not isinstance(e, httpx.TransportError)
                error = f"prefill {prefill.url} failed: {e!r}"
            finally:
                prefill.in_flight -= 1
        raise BackendError(503, error)

    async def probe_forever(self) -> None:
        """Brings instances marked down back once they answer (decode: Stats, prefill: /health)."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for decode in self.decodes:
                if not decode.healthy:
                    try:
                        await decode.stub.Stats(decode_pb2.StatsRequest(), timeout=2)
                        decode.healthy = True
                    except grpc.aio.AioRpcError:
                        pass
            for prefill in self.prefills:
                if not prefill.healthy:
                    with contextlib.suppress(httpx.HTTPError):
                        reply = await prefill.client.get("/health", timeout=2)
                        prefill.healthy = reply.status_code == 200

    def _pick_decode(self) -> DecodeInstance:
        healthy = [d for d in self.decodes if d.healthy]
        if not healthy:
            raise BackendError(503, "no decode instance is available")
        return min(healthy, key=lambda d: d.outstanding_tokens)

    async def _prefill(self, ticket, decode_address: str, request: GenerationRequest) -> int:
        params = {"tandem_ticket": base64.b64encode(ticket.SerializeToString()).decode(),
                  "decode_address": decode_address}  # fmt: skip
        body = {"prompt": request.prompt_ids, "max_tokens": 1, "kv_transfer_params": params,
                **_prefill_sampling(request.sampling)}  # fmt: skip
        error = "no prefill instance is available"
        delivered = False
        for prefill in self._prefill_order():
            prefill.in_flight += 1
            try:
                reply = await prefill.client.post("/v1/completions", json=body)
                delivered = True
                if reply.status_code == 200:
                    first = (reply.json().get("kv_transfer_params") or {}).get("first_token_id")
                    if isinstance(first, int):
                        return first
                    error = (
                        f"prefill {prefill.url} answered without a first_token_id: is it "
                        "tandem's prefill server, or vLLM with TandemConnector?"
                    )
                    break
                error = f"prefill {prefill.url} answered {reply.status_code}: {reply.text[:200]}"
                if reply.status_code == 503:
                    prefill.healthy = False
                if reply.status_code < 500:
                    break  # the request itself is at fault: another prefill would refuse it too
            except httpx.HTTPError as e:
                prefill.healthy = not isinstance(e, httpx.TransportError)
                delivered |= not isinstance(e, httpx.ConnectError)
                error = f"prefill {prefill.url} failed: {e!r}"
            finally:
                prefill.in_flight -= 1
        raise PrefillFailed(error, delivered)

    def _prefill_order(self) -> list[PrefillInstance]:
        """The instances to try, at most two (a failure is retried once, on another): least in
        flight first, healthy ones before those marked down (which may be back already)."""
        ranked = sorted(self.prefills, key=lambda p: (not p.healthy, p.in_flight))
        return ranked[:2]

    def _failed(self, decode: DecodeInstance, error: grpc.aio.AioRpcError) -> BackendError:
        code = error.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            decode.healthy = code != grpc.StatusCode.UNAVAILABLE and decode.healthy
            return BackendError(503, f"decode server {decode.address}: {error.details()}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return BackendError(503, f"decode server {decode.address} is full: {error.details()}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return BackendError(400, error.details())
        return BackendError(502, f"decode server {decode.address}: {error.details()}")

    async def _abort(
        self, decode: DecodeInstance, rid: str, reason: str, ticket_undelivered: bool = False
    ) -> None:
        # A failure means the decode server is gone or done with it: nothing left to stop.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await decode.stub.Abort(decode_pb2.AbortRequest(
                request_id=rid, reason=reason, ticket_undelivered=ticket_undelivered))  # fmt: skip


def _prefill_sampling(sampling: decode_pb2.SamplingParams) -> dict:
    """The request's sampling fields for the prefill, which samples the first token: the ones
    the client set, and the temperature always (unset means greedy here, as on the decode
    server; vLLM's own default would be the model's generation config)."""
    fields = {f.name: value for f, value in sampling.ListFields()}
    fields.setdefault("temperature", 0.0)
    return fields
