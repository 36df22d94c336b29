"""The orchestrator's two collaborators, as interfaces, and the real clients behind them:

  PrefillClient  complete / tokenize / health, per instance URL   HttpPrefillClient (httpx)
  DecodeClient   Reserve / Generate / Abort / Stats, per address   GrpcDecodeClient (grpc aio)

A prefill call answers a PrefillReply whatever the HTTP status, or raises PrefillCallError when
no answer came; a decode call raises grpc.aio.AioRpcError with the RPC's status. Interpreting
either (retry, mark down, which HTTP status to answer) is the orchestrator's job. The one fake
of each, for tests, is in router/tests/fakes.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import httpx

from engine.sampling_ranges import sampling_fields
from prefill import server_timing
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from router.structured import prefill_fields
from rpc import keepalive

# Idle connections to a prefill server are dropped after 2 s, before the server's own keep-alive
# timeout (5 s in uvicorn, tandem's prefill server and vLLM's alike) can close one as a request
# is sent on it: that race surfaced as a ReadError and a 503 under load.
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=2.0)
_PREFILL_TIMEOUT_S = 600
_HEALTH_TIMEOUT_S = 2
_RESERVE_TIMEOUT_S = 30
_STATS_TIMEOUT_S = 2
_JSON_BODY = {"content-type": "application/json"}
_DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]


@dataclass(frozen=True)
class PrefillReply:
    status: int
    json: dict | None
    """The body, if it is a JSON object."""
    text: str
    timing: dict[str, float] = field(default_factory=dict)
    """The reply's Server-Timing phases in ms (tandem's prefill: queue, forward, send), if any."""


class PrefillCallError(Exception):
    """A prefill call that got no HTTP answer. `sent`: the request may have reached the server
    (False only when no connection was made); `down`: the connection failed, so the instance is
    taken for down."""

    def __init__(self, message: str, *, sent: bool, down: bool) -> None:
        super().__init__(message)
        self.sent = sent
        self.down = down


class PrefillClient(Protocol):
    async def complete(
        self,
        url: str,
        prompt_ids: list[int],
        transfer_params: dict,
        sampling: decode_pb2.SamplingParams,
        structured: decode_pb2.StructuredOutput | None = None,
        n: int = 1,
    ) -> PrefillReply:
        """Prefills `prompt_ids` on instance `url`, handing it the ticket in `transfer_params`;
        a 200's JSON has `n` choices, each with the first token it sampled (`token_ids`) with
        `sampling` under the `structured` constraint, and the connector's kv_transfer_params."""
        ...

    async def tokenize(self, url: str, body: dict) -> PrefillReply:
        """POST /tokenize (`prompt` or `messages`); a 200's JSON carries `tokens`."""
        ...

    async def health(self, url: str) -> bool:
        """Whether the instance answers its health check with 200."""
        ...

    async def close(self) -> None: ...


class DecodeClient(Protocol):
    async def reserve(
        self, address: str, request: decode_pb2.ReserveRequest
    ) -> decode_pb2.ReserveResponse: ...

    def generate(
        self, address: str, request: decode_pb2.GenerateRequest
    ) -> AsyncGenerator[decode_pb2.GenerateResponse, None]:
        """The Generate stream; closing it early (aclose) cancels the RPC."""
        ...

    async def abort(
        self, address: str, request: decode_pb2.AbortRequest
    ) -> decode_pb2.AbortResponse: ...

    async def stats(self, address: str) -> decode_pb2.StatsResponse: ...

    async def close(self) -> None: ...


class HttpPrefillClient:
    """tandem's prefill server, or vLLM with TandemConnector: one connection pool per instance.
    NOTE: pools are opened at first use, so on the event loop that serves."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.transport = transport
        """None: the network (tests pass httpx.MockTransport)."""
        self._clients: dict[str, httpx.AsyncClient] = {}

    async def complete(
        self,
        url: str,
        prompt_ids: list[int],
        transfer_params: dict,
        sampling: decode_pb2.SamplingParams,
        structured: decode_pb2.StructuredOutput | None = None,
        n: int = 1,
    ) -> PrefillReply:
        body = {"prompt": prompt_ids, "max_tokens": 1, "n": n, "return_token_ids": True,
                "kv_transfer_params": transfer_params, **_prefill_sampling(sampling)}  # fmt: skip
        if structured is not None:
            body.update(prefill_fields(structured))
        return await self._post(url, "/v1/completions", body)

    async def tokenize(self, url: str, body: dict) -> PrefillReply:
        return await self._post(url, "/tokenize", body)

    async def health(self, url: str) -> bool:
        try:
            reply = await self._client(url).get("/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()

    async def _post(self, url: str, path: str, body: dict) -> PrefillReply:
        # Encoded on a thread: a 300k-token prompt is ~40 ms of JSON, which would stall every
        # stream the event loop sends.
        content = await asyncio.to_thread(json.dumps, body, separators=(",", ":"))
        try:
            reply = await self._client(url).post(path, content=content, headers=_JSON_BODY)
        except httpx.HTTPError as e:
            sent = not isinstance(e, httpx.ConnectError)
            down = isinstance(e, httpx.TransportError)
            raise PrefillCallError(repr(e), sent=sent, down=down) from e
        try:
            parsed = reply.json()
        except ValueError:
            parsed = None
        try:
            timing = server_timing.parse(reply.headers.get("server-timing", ""))
        except ValueError:  # not tandem's prefill, or not its header: no phases then
            timing = {}
        return PrefillReply(reply.status_code, parsed if isinstance(parsed, dict) else None,
                            reply.text, timing)  # fmt: skip

    def _client(self, url: str) -> httpx.AsyncClient:
        if url not in self._clients:
            self._clients[url] = httpx.AsyncClient(
                base_url=url, timeout=_PREFILL_TIMEOUT_S, limits=_LIMITS, transport=self.transport
            )
        return self._clients[url]


class GrpcDecodeClient:
    """tandem's decode servers over gRPC: one channel per address. Reserve and Generate
    requests, which may carry a long prompt's ids, are serialized on a thread (a 300k-token
    prompt: ~13 ms), not on the event loop that sends every stream.
    NOTE: channels are opened at first use: a grpc.aio channel binds to the running event loop,
    which must be the one that serves."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, decode_pb2_grpc.DecodeServiceStub] = {}
        self._methods: dict[tuple[str, str], object] = {}

    async def reserve(
        self, address: str, request: decode_pb2.ReserveRequest
    ) -> decode_pb2.ReserveResponse:
        payload = await asyncio.to_thread(request.SerializeToString)
        reserve = self._method(address, "Reserve", decode_pb2.ReserveResponse, "unary_unary")
        return await reserve(payload, timeout=_RESERVE_TIMEOUT_S)

    async def generate(
        self, address: str, request: decode_pb2.GenerateRequest
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        payload = await asyncio.to_thread(request.SerializeToString)
        call = self._method(address, "Generate", decode_pb2.GenerateResponse, "unary_stream")(
            payload
        )
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def abort(
        self, address: str, request: decode_pb2.AbortRequest
    ) -> decode_pb2.AbortResponse:
        return await self._stub(address).Abort(request)

    async def stats(self, address: str) -> decode_pb2.StatsResponse:
        # wait_for_ready: a channel whose server went away retries its connection with a
        # growing backoff, and without it an RPC in that backoff fails at once, even when a
        # server has come back on the address meanwhile (restarted): this waits (up to the
        # timeout) for the connection instead.
        return await self._stub(address).Stats(
            decode_pb2.StatsRequest(), timeout=_STATS_TIMEOUT_S, wait_for_ready=True
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(
                address, options=keepalive.CHANNEL_OPTIONS
            )
        return self._channels[address]

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        if address not in self._stubs:
            self._stubs[address] = decode_pb2_grpc.DecodeServiceStub(self._channel(address))
        return self._stubs[address]

    def _method(self, address: str, name: str, response, kind: str):
        """DecodeService's `name` on `address`'s channel, taking a serialized request."""
        if (address, name) not in self._methods:
            path = f"/{_DECODE_SERVICE.full_name}/{name}"
            self._methods[address, name] = getattr(self._channel(address), kind)(
                path, request_serializer=None, response_deserializer=response.FromString
            )
        return self._methods[address, name]


def _prefill_sampling(sampling: decode_pb2.SamplingParams) -> dict:
    """The request's sampling fields for the prefill, which samples the first token: the
    temperature always (the router sets it; unset, greedy here as on the decode server, where
    vLLM's own default would be the model's generation config)."""
    fields = sampling_fields(sampling)
    fields.setdefault("temperature", 0.0)
    if "logprobs" in fields:  # named by id: router/logprobs.py reads them so
        fields["return_tokens_as_token_ids"] = True
    return fields
