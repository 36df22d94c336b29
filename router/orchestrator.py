"""One request through the disaggregated stack (docs/design.md, steps 2-5):

  pick a decode instance (the fewest outstanding tokens; among those caching prefixes, the
  fewest tokens in hand once it holds the prompt: router/prefix_affinity.py) -> Reserve -> pick
  a prefill instance (least in flight) -> prefill with the ticket (on failure: once more, on
  another prefill), which samples every choice's first token and sends the prompt's KV once
  -> Generate, streamed back as lists of token ids, then a Finished, per choice.

Cancelling the consumer (client gone) aborts the request on the decode server, and so does a
prefill failure (the reservation is released at once instead of at its deadline); a consumer
done with one choice (a stop string) stops that one alone. A decode
instance whose RPC fails with UNAVAILABLE is marked down until a Stats probe answers and says it
is not draining (a decode server shutting down refuses new requests so); a Reserve that fails
so is sent to another decode instance, nothing having been sent anywhere yet. A prefill
instance that cannot be reached or answers 503 (its engine failed) is marked down until its
health check answers 200. Which instances there are and which are up: router/membership.py;
with no decode instance up, a request asks the down ones again before it is refused.

Aggregated (every request), or while no prefill instance is healthy (the decode-only fallback,
counted and logged: router/decode_only.py), a request skips Reserve and the prefill: its decode
server prefills the prompt itself (GenerateRequest.local_prefill), and the rest is the same. A
request whose prefill failed because none is healthy any longer falls back too.

The instances are reached through a PrefillClient and a DecodeClient (router/clients.py),
given to the constructor; what is read and written on the way is router/wire.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from prefill.ticket import transfer_params
from proto.tandem.v1 import decode_pb2
from router.clients import DecodeClient, PrefillCallError, PrefillClient
from router.decode_only import DecodeOnly
from router.errors import BackendError
from router.generation import Finished, GenerationRequest, Tokens
from router.logprobs import LogprobsError
from router.membership import DecodeInstance, Membership, PrefillInstance
from router.prompt_order import PromptLogprobsFirst
from router.wire import (
    FirstToken,
    FirstTokenMissing,
    first_tokens,
    generate_request,
    message_items,
    refusal,
)


class PrefillFailed(BackendError):
    """No prefill instance prefilled the request; `ticket_delivered` is False when none even
    accepted the connection (so nothing can be writing into the reserved blocks). `status`: 503,
    or the 4xx a prefill refused the request with (the client's fault, passed on)."""

    def __init__(self, message: str, ticket_delivered: bool, status: int = 503) -> None:
        super().__init__(status, message)
        self.ticket_delivered = ticket_delivered


class Orchestrator(Membership):
    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_addresses: Sequence[str],
        prefill_client: PrefillClient,
        decode_client: DecodeClient,
        aggregated: bool = False,
        decode_only_fallback: bool = True,
    ) -> None:
        """`aggregated`: every request is prefilled by its decode server (no prefill URL is
        needed); `decode_only_fallback`: so is each request while no prefill is healthy."""
        self.prefills = [PrefillInstance(url) for url in prefill_urls]
        self.decodes = [DecodeInstance(address) for address in decode_addresses]
        self.prefill_client = prefill_client
        self.decode_client = decode_client
        self.decode_only = DecodeOnly(aggregated, decode_only_fallback)
        self._ids = itertools.count(1)
        self.on_phase: Callable[[str, float], None] = lambda phase, seconds: None
        """Told how long each step of a request took (router.metrics' phase histogram)."""

    def generate(self, request: GenerationRequest, request_id: str) -> Generation:
        """The request's generation, started when first iterated: Tokens as the decode server
        streams them and a Finished per choice; a failure raises BackendError with the HTTP
        status to answer."""
        return Generation(self, request, request_id)

    async def _generate(
        self, request: GenerationRequest, request_id: str, placed: Generation
    ) -> AsyncIterator[Tokens | Finished]:
        decode, names = await self._pick_decode(request.prompt_ids)
        outstanding = request.max_tokens * request.n
        active = len(request.prompt_ids) + outstanding
        decode.outstanding_tokens += outstanding
        decode.active_tokens += active
        rid = f"{request_id}-{next(self._ids)}"
        live = set(range(request.n))
        arrival = _Arrival(decode)
        try:
            while True:
                try:
                    generate, prompt = await self._placed(decode, rid, request, placed, arrival)
                    break
                except grpc.aio.AioRpcError as e:
                    # Only Reserve raises here, before anything was sent: a decode server that
                    # is draining or down; the request goes to another one, if any is left.
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    decode.healthy = False
                    arrival.end()
                    other, names = await self._pick_decode(request.prompt_ids)
                    decode.outstanding_tokens -= outstanding
                    other.outstanding_tokens += outstanding
                    decode.active_tokens -= active
                    other.active_tokens += active
                    decode, arrival = other, _Arrival(other)
            decode.placed.place(names)
            stream = self.decode_client.generate(decode.address, generate)
            called = time.monotonic()
            local = generate.HasField("local_prefill")
            asked = local and request.sampling.HasField("prompt_logprobs")
            order = PromptLogprobsFirst(request.n, request.prompt_ids, prompt, asked)
            async with contextlib.aclosing(stream):
                async for message in stream:
                    if called:  # with the prompt's prefill where the decode server does it
                        phase = "local_prefill" if local else "first_message"
                        self.on_phase(phase, time.monotonic() - called)
                        called = 0.0
                    arrival.end()  # a Generate it prefills itself was taken
                    for item in order.items(message, message_items(message)):
                        # NOTE: consumers close the stream after the last Finished, without
                        # reading past it: that is no client gone, and nothing is left to abort.
                        if isinstance(item, Finished):
                            live.discard(item.index)
                        yield item
                        if not live:
                            return
            raise BackendError(502, f"decode server {decode.address} ended the stream early")
        except grpc.aio.AioRpcError as e:
            raise self._failed(decode, e) from None
        except (asyncio.CancelledError, GeneratorExit):
            # The client is gone: stop decoding for it, or release its reservation (kept
            # quarantined by the decode server until a prefill still writing into it commits).
            if placed.placement is not None and live:
                await asyncio.shield(self._abort(decode, rid, "client gone"))
            raise
        finally:
            arrival.end()
            placed.placement = None
            decode.outstanding_tokens -= outstanding
            decode.active_tokens -= active

    async def _placed(
        self,
        decode: DecodeInstance,
        rid: str,
        request: GenerationRequest,
        placed: Generation,
        arrival: _Arrival,
    ) -> tuple[decode_pb2.GenerateRequest, list[decode_pb2.TokenLogprobs] | None]:
        """The request placed on `decode` as `rid`: reserved and prefilled, or, skipping both,
        to be prefilled there; returns its Generate call, and the prompt's log-probabilities
        where the prefill gave them. `arrival` ends once the decode server has taken the
        request (its Reserve answered)."""
        if self.decode_only.skip_prefill(self._any_prefill_healthy()):
            placed.placement = (decode, rid)
            return await asyncio.to_thread(generate_request, request, rid), None
        started = time.monotonic()
        try:
            # NOTE: messages that carry the prompt's ids are built on a thread: a 300k-token
            # context costs ~20 ms of list-to-protobuf copying, which would stall every stream.
            reserve = await asyncio.to_thread(
                # num_senders 0: as many as the prefill has (each sender's commit names them).
                decode_pb2.ReserveRequest, request_id=rid, prompt_token_ids=request.prompt_ids,
                num_senders=0, max_tokens=request.max_tokens,
            )  # fmt: skip
            reserved = await self.decode_client.reserve(decode.address, reserve)
        except asyncio.CancelledError:
            # The client is gone while the decode server may have reserved already (its answer
            # on its way): no prefill has the ticket, so the blocks can be freed at once rather
            # than at the ticket's deadline.
            await asyncio.shield(self._abort(decode, rid, "client gone", True))
            raise
        finally:
            arrival.end()
        placed.placement = (decode, rid)
        reserved_at = time.monotonic()
        self.on_phase("reserve", reserved_at - started)
        try:
            firsts, prompt = await self._prefill(reserved.ticket, decode.address, request)
            self.on_phase("prefill", time.monotonic() - reserved_at)
        except PrefillFailed as e:
            undelivered = not e.ticket_delivered
            await asyncio.shield(self._abort(decode, rid, "prefill failed", undelivered))
            # The last healthy prefill just went down: this request is the fallback's first.
            if e.status == 503 and self.decode_only.skip_prefill(self._any_prefill_healthy()):
                return await asyncio.to_thread(generate_request, request, rid), None
            raise
        return generate_request(request, rid, reserved.ticket, firsts), prompt

    async def close(self) -> None:
        await self.prefill_client.close()
        await self.decode_client.close()

    async def tokenize(self, body: dict) -> list[int]:
        """Token ids from a prefill instance's /tokenize (`prompt` or `messages`); a failure is
        retried once, on another instance, as the prefill itself is."""
        error = "no prefill instance is available"
        for prefill in self._prefill_order():
            if not self._listed(prefill):  # removed while the one before was asked
                continue
            prefill.in_flight += 1
            try:
                reply = await self.prefill_client.tokenize(prefill.url, body)
                tokens = (reply.json or {}).get("tokens")
                if reply.status == 200 and isinstance(tokens, list):
                    return tokens
                error = f"prefill {prefill.url} /tokenize: {reply.status} {reply.text[:200]}"
                if reply.status == 503:  # its engine failed: down until its health check says 200
                    prefill.healthy = False
                if reply.status < 500 and reply.status != 200:  # another would refuse it too
                    raise BackendError(reply.status, error)
            except PrefillCallError as e:
                prefill.healthy = not e.down
                error = f"prefill {prefill.url} failed: {e}"
            finally:
                prefill.in_flight -= 1
        raise BackendError(503, error)

    async def _prefill(
        self, ticket: decode_pb2.Ticket, decode_address: str, request: GenerationRequest
    ) -> tuple[list[FirstToken], list[decode_pb2.TokenLogprobs] | None]:
        """Each choice's first token, from the first prefill instance to prefill the
        request, and the prompt's log-probabilities when asked."""
        params = transfer_params(ticket, decode_address)
        error = "no prefill instance is available"
        delivered = False
        status = 503
        for prefill in self._prefill_order():
            if not self._listed(prefill):  # removed while the one before was asked
                continue
            prefill.in_flight += 1
            try:
                reply = await self.prefill_client.complete(prefill.url, request.prompt_ids,
                    params, request.sampling, request.structured, request.n)  # fmt: skip
                delivered = True
                if reply.status == 200:
                    for name, ms in reply.timing.items():  # the prefill's own account of it
                        self.on_phase(f"prefill_{name}", ms / 1000)
                    try:
                        return first_tokens(reply.json or {}, request)
                    except LogprobsError as e:
                        error = f"prefill {prefill.url}: {e}"
                    except FirstTokenMissing as e:
                        error = f"prefill {prefill.url}: {e}"
                    status = 502
                    break
                error = f"prefill {prefill.url} answered {reply.status}: {reply.text[:200]}"
                if reply.status == 503:
                    prefill.healthy = False
                if 400 <= reply.status < 500:  # the request is at fault: passed on as it is
                    status, error = reply.status, refusal(reply)
                    break
                if reply.status < 500:
                    status = 502
                    break
            except PrefillCallError as e:
                prefill.healthy = not e.down
                delivered |= e.sent
                error = f"prefill {prefill.url} failed: {e}"
            finally:
                prefill.in_flight -= 1
        raise PrefillFailed(error, delivered, status)

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
        self,
        decode: DecodeInstance,
        rid: str,
        reason: str,
        ticket_undelivered: bool = False,
        choices: Sequence[int] = (),
    ) -> None:
        # A failure means the decode server is gone or done with it: nothing left to stop.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.decode_client.abort(decode.address, decode_pb2.AbortRequest(
                request_id=rid, reason=reason, ticket_undelivered=ticket_undelivered,
                choices=choices))  # fmt: skip


class _Arrival:
    """A request on its way to a decode instance (DecodeInstance.arriving) until `end`."""

    def __init__(self, decode: DecodeInstance) -> None:
        self._decode: DecodeInstance | None = decode
        decode.arriving += 1

    def end(self) -> None:
        if self._decode is not None:
            self._decode.arriving -= 1
            self._decode = None


class Generation:
    """One request on its way through the stack: iterate it for its Tokens and Finished (it
    starts then); `stop_choice` ends one of its choices early, and closing it ends them all."""

    def __init__(
        self, orchestrator: Orchestrator, request: GenerationRequest, request_id: str
    ) -> None:
        self._orchestrator = orchestrator
        self.placement: tuple[DecodeInstance, str] | None = None
        """The decode instance and request id while the request lives there."""
        self._items = orchestrator._generate(request, request_id, self)

    def __aiter__(self) -> AsyncIterator[Tokens | Finished]:
        return self._items

    async def __anext__(self) -> Tokens | Finished:
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._items.aclose()

    async def stop_choice(self, index: int) -> None:
        """Stops generating choice `index` (the client has what it wants of it, e.g. up to a
        stop string); its remaining Tokens and its Finished may still come and mean nothing."""
        if self.placement is not None:
            decode, rid = self.placement
            await self._orchestrator._abort(decode, rid, "choice done", choices=[index])
