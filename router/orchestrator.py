"""One request through the disaggregated stack (docs/design.md, steps 2-5):

  pick a decode instance (least outstanding tokens) -> Reserve -> pick a prefill instance (least
  in flight) -> prefill with the ticket (on failure: once more, on another prefill)
  -> Generate, streamed back as lists of token ids, then a Finished.

Cancelling the consumer (client gone) aborts the request on the decode server, and so does a
prefill failure (the reservation is released at once instead of at its deadline). A decode
instance whose RPC fails with UNAVAILABLE is marked down until a Stats probe answers; a prefill
instance that cannot be reached or answers 503 (its engine failed) is marked down until its
health check answers 200.

The instances are reached through a PrefillClient and a DecodeClient (router/clients.py),
given to the constructor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from prefill.ticket import transfer_params
from proto.tandem.v1 import decode_pb2
from router.clients import DecodeClient, PrefillCallError, PrefillClient, PrefillReply
from router.errors import BackendError
from router.generation import Finished, GenerationRequest, Tokens
from router.logprobs import LogprobsError, first_token_logprobs

PROBE_INTERVAL_S = 2.0


class PrefillFailed(BackendError):
    """No prefill instance prefilled the request; `ticket_delivered` is False when none even
    accepted the connection (so nothing can be writing into the reserved blocks). `status`: 503,
    or the 4xx a prefill refused the request with (the client's fault, passed on)."""

    def __init__(self, message: str, ticket_delivered: bool, status: int = 503) -> None:
        super().__init__(status, message)
        self.ticket_delivered = ticket_delivered


@dataclass
class PrefillInstance:
    url: str
    in_flight: int = 0
    healthy: bool = True


@dataclass
class DecodeInstance:
    address: str
    outstanding_tokens: int = 0
    healthy: bool = True
    max_model_len: int = 0
    """The longest sequence it decodes, as its Stats said; 0 until it answered."""


_FINISH = {
    decode_pb2.FINISH_REASON_STOP: "stop",
    decode_pb2.FINISH_REASON_LENGTH: "length",
    decode_pb2.FINISH_REASON_ABORT: "abort",
}


class Orchestrator:
    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_addresses: Sequence[str],
        prefill_client: PrefillClient,
        decode_client: DecodeClient,
    ) -> None:
        self.prefills = [PrefillInstance(url) for url in prefill_urls]
        self.decodes = [DecodeInstance(address) for address in decode_addresses]
        self.prefill_client = prefill_client
        self.decode_client = decode_client
        self._ids = itertools.count(1)

    async def generate(
        self, request: GenerationRequest, request_id: str
    ) -> AsyncIterator[Tokens | Finished]:
        """Tokens as the decode server streams them, then a Finished; a failure raises
        BackendError with the HTTP status to answer."""
        decode = self._pick_decode()
        decode.outstanding_tokens += request.max_tokens
        rid = f"{request_id}-{next(self._ids)}"
        reserved = None
        finished = False
        try:
            reserved = await self.decode_client.reserve(decode.address, decode_pb2.ReserveRequest(
                request_id=rid, prompt_token_ids=request.prompt_ids, num_senders=1,
                max_tokens=request.max_tokens))  # fmt: skip
            try:
                first, first_logprobs = await self._prefill(
                    reserved.ticket, decode.address, request
                )
            except PrefillFailed as e:
                undelivered = not e.ticket_delivered
                await asyncio.shield(self._abort(decode, rid, "prefill failed", undelivered))
                raise
            stream = self.decode_client.generate(decode.address, decode_pb2.GenerateRequest(
                request_id=rid, generation=reserved.ticket.generation, first_token_id=first,
                sampling=request.sampling, max_tokens=request.max_tokens,
                min_tokens=request.min_tokens, stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos, first_token_logprobs=first_logprobs,
                structured_output=request.structured))  # fmt: skip
            async with contextlib.aclosing(stream):
                async for message in stream:
                    if message.token_ids:
                        on_stop = message.finish_reason == decode_pb2.FINISH_REASON_STOP
                        yield Tokens(list(message.token_ids), list(message.logprobs), on_stop)
                    if message.finish_reason != decode_pb2.FINISH_REASON_UNSPECIFIED:
                        usage = message.usage
                        reason = _FINISH[message.finish_reason]
                        # NOTE: consumers close the stream on this Finished, without reading
                        # past it: that is no client gone, and nothing is left to abort.
                        finished = True
                        yield Finished(reason, usage.prompt_tokens, usage.completion_tokens)
                        return
            raise BackendError(502, f"decode server {decode.address} ended the stream early")
        except grpc.aio.AioRpcError as e:
            raise self._failed(decode, e) from None
        except (asyncio.CancelledError, GeneratorExit):
            # The client is gone: stop decoding for it, or release its reservation (kept
            # quarantined by the decode server until a prefill still writing into it commits).
            if reserved is not None and not finished:
                await asyncio.shield(self._abort(decode, rid, "client gone"))
            raise
        finally:
            decode.outstanding_tokens -= request.max_tokens

    async def close(self) -> None:
        await self.prefill_client.close()
        await self.decode_client.close()

    async def tokenize(self, body: dict) -> list[int]:
        """Token ids from a prefill instance's /tokenize (`prompt` or `messages`); a failure is
        retried once, on another instance, as the prefill itself is."""
        error = "no prefill instance is available"
        for prefill in self._prefill_order():
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

    async def probe(self, every_decode: bool = False) -> None:
        """Brings instances marked down back once they answer (decode: Stats, prefill: its
        health check), and learns the decode servers' context lengths."""
        for decode in self.decodes:
            if every_decode or not decode.healthy or not decode.max_model_len:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    stats = await self.decode_client.stats(decode.address)
                    decode.healthy = True
                    decode.max_model_len = stats.max_model_len
        for prefill in self.prefills:
            if not prefill.healthy:
                prefill.healthy = await self.prefill_client.health(prefill.url)

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await self.probe()

    def max_model_len(self, configured: int) -> int:
        """The context a request may fill: `configured` (the model's), or less where a decode
        server said it decodes less."""
        return min((d.max_model_len for d in self.decodes if d.max_model_len), default=configured)

    def _pick_decode(self) -> DecodeInstance:
        healthy = [d for d in self.decodes if d.healthy]
        if not healthy:
            raise BackendError(503, "no decode instance is available")
        return min(healthy, key=lambda d: d.outstanding_tokens)

    async def _prefill(
        self, ticket: decode_pb2.Ticket, decode_address: str, request: GenerationRequest
    ) -> tuple[int, decode_pb2.TokenLogprobs | None]:
        """The first token id, and its log-probabilities if the request asks for them, from
        the first prefill instance to prefill the request."""
        params = transfer_params(ticket, decode_address)
        error = "no prefill instance is available"
        delivered = False
        status = 503
        for prefill in self._prefill_order():
            prefill.in_flight += 1
            try:
                reply = await self.prefill_client.complete(
                    prefill.url, request.prompt_ids, params, request.sampling, request.structured
                )
                delivered = True
                if reply.status == 200:
                    try:
                        return _first_token(reply.json or {}, request.sampling)
                    except LogprobsError as e:
                        error = f"prefill {prefill.url}: {e}"
                    except (TypeError, ValueError):
                        error = (
                            f"prefill {prefill.url} answered without a first_token_id: is it "
                            "tandem's prefill server, or vLLM with TandemConnector?"
                        )
                    status = 502
                    break
                error = f"prefill {prefill.url} answered {reply.status}: {reply.text[:200]}"
                if reply.status == 503:
                    prefill.healthy = False
                if 400 <= reply.status < 500:  # the request is at fault: passed on as it is
                    status, error = reply.status, _refusal(reply)
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
            await self.decode_client.abort(decode.address, decode_pb2.AbortRequest(
                request_id=rid, reason=reason, ticket_undelivered=ticket_undelivered))  # fmt: skip


def _first_token(reply: dict, sampling: decode_pb2.SamplingParams):
    """(first token id, its logprobs or None) from a prefill's 200 reply; ValueError or
    TypeError when it has no first_token_id, LogprobsError when it lacks asked-for logprobs."""
    first = (reply.get("kv_transfer_params") or {}).get("first_token_id")
    if not isinstance(first, int) or isinstance(first, bool):
        raise ValueError("no first_token_id")
    if not sampling.HasField("logprobs"):
        return first, None
    choices = reply.get("choices") or [{}]
    return first, first_token_logprobs(choices[0], sampling.logprobs)


def _refusal(reply: PrefillReply) -> str:
    """A prefill's 4xx message as the client gets it: the error body's message (OpenAI's
    shape, or vLLM's older flat one), else the text."""
    body = reply.json or {}
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else body.get("message")
    return message if isinstance(message, str) and message else reply.text[:500]
