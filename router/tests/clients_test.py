"""HttpPrefillClient over httpx's in-process transport: the body a prefill receives, answers of
any status as PrefillReply, and failures without an answer as PrefillCallError saying whether
the request may have been sent and whether the instance is down. GrpcDecodeClient against an
in-process gRPC server. Both encode requests off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import types

import grpc
import httpx
import pytest

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from router import clients
from router.clients import GrpcDecodeClient, HttpPrefillClient, PrefillCallError, PrefillReply

URL = "http://prefill-0"


def _call(handler, method: str, *args):
    client = HttpPrefillClient(httpx.MockTransport(handler))

    async def run():
        try:
            return await getattr(client, method)(URL, *args)
        except PrefillCallError as e:
            return e
        finally:
            await client.close()

    return asyncio.run(run())


def test_complete_posts_the_prompt_the_ticket_and_the_sampling_fields_set():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url, json.loads(request.content)))
        return httpx.Response(200, json={"kv_transfer_params": {"first_token_id": 5}})

    params = {"tandem_ticket": "AAA=", "decode_address": "d:1"}
    for sampling, expected in [
        (decode_pb2.SamplingParams(), {"temperature": 0.0}),  # unset: greedy, not vLLM's default
        (decode_pb2.SamplingParams(temperature=0.5, seed=3), {"temperature": 0.5, "seed": 3}),
        # A map, in JSON an object keyed by the ids' strings, as vLLM's logit_bias.
        (
            decode_pb2.SamplingParams(logit_bias={7: -100.0, 3: 0.5}),
            {"temperature": 0.0, "logit_bias": {"7": -100.0, "3": 0.5}},
        ),
    ]:
        reply = _call(handler, "complete", [1, 2], params, sampling)
        assert reply == PrefillReply(200, {"kv_transfer_params": {"first_token_id": 5}},
                                     '{"kv_transfer_params":{"first_token_id":5}}')  # fmt: skip
        url, body = seen.pop()
        assert str(url) == f"{URL}/v1/completions"
        assert body == {"prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": params,
                        "n": 1, "return_token_ids": True, **expected}  # fmt: skip


def test_the_prefills_server_timing_is_read_and_a_malformed_one_ignored():
    timed = {"server-timing": "queue;dur=0.250, forward;dur=31.500, send;dur=2.000"}
    reply = _call(lambda r: httpx.Response(200, json={}, headers=timed), "complete", [1], {},
                  decode_pb2.SamplingParams())  # fmt: skip
    assert reply.timing == {"queue": 0.25, "forward": 31.5, "send": 2.0}
    garbled = {"server-timing": "forward;dur=fast"}
    reply = _call(lambda r: httpx.Response(200, json={}, headers=garbled), "complete", [1], {},
                  decode_pb2.SamplingParams())  # fmt: skip
    assert reply.status == 200 and reply.timing == {}


def test_any_status_is_an_answer_and_a_body_that_is_no_json_object_has_no_json():
    reply = _call(lambda r: httpx.Response(503, text="engine failed"), "tokenize", {"prompt": "x"})
    assert reply == PrefillReply(503, None, "engine failed")
    reply = _call(lambda r: httpx.Response(200, json=[1, 2]), "tokenize", {"prompt": "x"})
    assert reply.json is None


def _raise(error: httpx.HTTPError):
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    return handler


@pytest.mark.parametrize(
    ("error", "sent", "down"),
    [
        (httpx.ConnectError("refused"), False, True),
        (httpx.ConnectTimeout("slow"), True, True),
        (httpx.ReadError("reset"), True, True),
        (httpx.DecodingError("bad gzip"), True, False),
    ],
)
def test_no_answer_says_whether_the_request_may_have_been_sent_and_the_instance_is_down(
    error, sent, down
):
    failure = _call(_raise(error), "tokenize", {"prompt": "x"})
    assert isinstance(failure, PrefillCallError)
    assert (failure.sent, failure.down, str(failure)) == (sent, down, repr(error))


def test_health_is_a_200():
    assert _call(lambda r: httpx.Response(200, json={"status": "ok"}), "health") is True
    assert _call(lambda r: httpx.Response(503), "health") is False
    assert _call(_raise(httpx.ConnectError("refused")), "health") is False


def test_a_long_prompts_body_is_encoded_off_the_event_loop(monkeypatch):
    """A 300k-token prompt is ~40 ms of JSON: encoded on the loop it would stall every stream."""
    encoders, seen = [], []

    def dumps(body, **kwargs):
        encoders.append(threading.get_ident())
        return json.dumps(body, **kwargs)

    monkeypatch.setattr(clients, "json", types.SimpleNamespace(dumps=dumps))
    prompt = list(range(300_000))

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, json={})

    loop_thread = []

    async def run():
        loop_thread.append(threading.get_ident())
        client = HttpPrefillClient(httpx.MockTransport(handler))
        try:
            return await client.complete(URL, prompt, {}, decode_pb2.SamplingParams())
        finally:
            await client.close()

    assert asyncio.run(run()).status == 200
    assert seen == [prompt] and encoders and loop_thread[0] not in encoders


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    async def Reserve(self, request, context):
        ticket = decode_pb2.Ticket(request_id=request.request_id,
                                   num_tokens=len(request.prompt_token_ids))  # fmt: skip
        return decode_pb2.ReserveResponse(ticket=ticket)

    async def Generate(self, request, context):
        for token in (request.first_token_id, request.first_token_id + 1):
            yield decode_pb2.GenerateResponse(token_ids=[token])


class _Serialized:
    """A request that notes the thread serializing it."""

    def __init__(self, message, threads: list[int]) -> None:
        self.message, self.threads = message, threads

    def SerializeToString(self) -> bytes:
        self.threads.append(threading.get_ident())
        return self.message.SerializeToString()


def test_decode_requests_are_serialized_off_the_event_loop():
    async def run():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client, threads = GrpcDecodeClient(), []
        try:
            address = f"127.0.0.1:{port}"
            reserve = decode_pb2.ReserveRequest(request_id="r", prompt_token_ids=range(1000))
            reply = await client.reserve(address, _Serialized(reserve, threads))
            assert (reply.ticket.request_id, reply.ticket.num_tokens) == ("r", 1000)
            generate = decode_pb2.GenerateRequest(request_id="r", first_token_id=7)
            stream = client.generate(address, _Serialized(generate, threads))
            assert [list(m.token_ids) async for m in stream] == [[7], [8]]
            assert len(threads) == 2 and threading.get_ident() not in threads
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())
