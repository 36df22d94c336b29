"""Failures behind the router: a decode server killed mid-stream ends the client's stream with an
error event within 5 s and later requests are served by the remaining decode server; a killed
prefill server is retried on another, and with none left (and the decode-only fallback off) the
client gets a 503; a prefill whose
engine failed (it answers 503) is marked down until its /health answers again. Afterwards no
KV block stays allocated on the surviving decode server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import (
    MODEL,
    decode_pool_free,
    start_decode,
    start_prefill,
    start_router,
    stop,
)

REQUEST = {"model": MODEL, "prompt": "Count to ten:", "max_tokens": 6, "temperature": 0}


def _stats(address: str) -> decode_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return decode_pb2_grpc.DecodeServiceStub(channel).Stats(
            decode_pb2.StatsRequest(), timeout=5
        )


@pytest.fixture()
def two_decodes():
    decodes = [start_decode("tcp") for _ in range(2)]
    prefill, prefill_url = start_prefill("tcp")
    router, url = start_router([prefill_url], [address for _, address in decodes])
    yield url, decodes
    stop(router, prefill, *(proc for proc, _ in decodes))


@pytest.fixture()
def two_prefills():
    decode, address = start_decode("tcp")
    prefills = [start_prefill("tcp") for _ in range(2)]
    # Without the decode-only fallback (tests/aggregated_test.py), none left is a 503.
    router, url = start_router([prefill_url for _, prefill_url in prefills], [address],
                               "--no-decode-only-fallback")  # fmt: skip
    yield url, address, [proc for proc, _ in prefills]
    stop(router, decode, *(proc for proc, _ in prefills))


def test_decode_killed_mid_stream_ends_the_stream_with_an_error_then_the_other_serves(two_decodes):
    url, decodes = two_decodes
    body = {**REQUEST, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # decoding has begun
        # Admitted: waiting for its first step or running (Stats reads the engine's snapshot).
        held = [(lambda s: s.running + s.waiting)(_stats(address)) for _, address in decodes]
        assert sorted(held) == [0, 1], "exactly one decode server has the request"
        (victim, _), (_, survivor) = decodes[held.index(1)], decodes[held.index(0)]
        victim.kill()
        killed = time.monotonic()
        events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 5.0
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] >= 500 and error["message"]
    for _ in range(3):
        reply = httpx.post(f"{url}/v1/completions", json=REQUEST, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == REQUEST["max_tokens"]
    health = httpx.get(f"{url}/health").json()["decode"]
    assert sorted(health.values()) == ["down", "up"] and health[survivor] == "up"
    assert decode_pool_free(survivor)


def test_killed_prefill_is_retried_on_the_other_and_none_left_gives_503(two_prefills):
    url, decode_address, prefills = two_prefills
    prefills[0].kill()
    prefills[0].wait(timeout=10)
    for _ in range(4):  # whichever the router tries first, each request is served
        reply = httpx.post(f"{url}/v1/completions", json=REQUEST, timeout=30)
        assert reply.status_code == 200, reply.text
    prefills[1].kill()
    prefills[1].wait(timeout=10)
    started = time.monotonic()
    reply = httpx.post(f"{url}/v1/completions", json=REQUEST, timeout=30)
    assert reply.status_code == 503 and time.monotonic() - started < 5.0
    assert "prefill" in reply.json()["error"]["message"]
    assert decode_pool_free(decode_address)  # released at once: the ticket never reached a prefill


class FailedPrefill:
    """Answers as tandem's prefill server does once its engine has failed: 503 with an OpenAI
    error body to everything, /health included, until `recovered` is set."""

    def __init__(self) -> None:
        self.completions = 0
        self.recovered = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer(200 if outer.recovered else 503)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/completions":
                    outer.completions += 1
                self._answer(503)

            def _answer(self, status: int) -> None:
                message = "prefill engine failed: RuntimeError: CUDA error (restart it)"
                body = {"status": "ok"} if status == 200 else {"error": {"message": message}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_prefill_answering_503_is_passed_over_until_its_health_is_back():
    failed = FailedPrefill()
    decode, address = start_decode("tcp")
    prefill, prefill_url = start_prefill("tcp")
    router, url = start_router([failed.url, prefill_url], [address])  # the failed one first
    try:
        for _ in range(3):
            reply = httpx.post(f"{url}/v1/completions", json=REQUEST, timeout=30)
            assert reply.status_code == 200, reply.text
        assert failed.completions <= 1, "marked down at its first 503, not tried first each time"
        health = httpx.get(f"{url}/health").json()["prefill"]
        assert health == {failed.url: "down", prefill_url: "up"}
        failed.recovered = True
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["prefill"][failed.url] == "down":
            assert time.monotonic() < deadline, "never probed back up"
            time.sleep(0.2)
        assert decode_pool_free(address)
    finally:
        stop(router, prefill, decode)
        failed.server.shutdown()
