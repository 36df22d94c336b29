"""Instances that go and come back, with real processes (the bundled SmolLM2 on the CPU).
Draining a decode server (SIGTERM, over tcp): it refuses new requests at once and the router
sends them to the other decode server, while the stream it is running goes on to its last token;
then it exits 0. With a short grace a stream that cannot finish in time ends with an error
event, and the server still exits 0. A decode server restarted on its address (new transport
endpoints, new memory) serves the next request at once over every transport: nothing the
prefill cached of the old one is used.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.servers import (
    complete,
    counter,
    metrics_url,
    start_decode,
    start_prefill,
    start_router,
    stream_long,
)


def _running(address: str) -> float:
    return counter(metrics_url(address), "tandem_decode_running")


def test_a_draining_decode_server_finishes_its_stream_and_the_router_goes_elsewhere():
    procs = []
    try:
        first, first_address = start_decode("tcp")
        second, second_address = start_decode("tcp")
        prefill, prefill_url = start_prefill("tcp")
        procs += [first, second, prefill]
        router, url = start_router([prefill_url], [first_address, second_address])
        procs.append(router)
        served_meanwhile = []

        def drain_and_ask():
            # The router picks the least loaded: with nothing in flight, the first one.
            assert _running(first_address) == 1
            first.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            served_meanwhile.append(complete(url))

        chunks, error, finish = stream_long(url, 120, drain_and_ask)
        assert error is None and finish == "length" and chunks >= 100
        (reply,) = served_meanwhile
        assert reply.status_code == 200, reply.text
        assert counter(metrics_url(second_address), "tandem_decode_tokens_generated_total") >= 8
        assert first.wait(timeout=30) == 0
        assert complete(url).status_code == 200  # the second one serves from now on
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_a_stream_longer_than_the_grace_is_cut_and_the_server_exits_0():
    procs = []
    try:
        decode, address = start_decode("tcp", "float32", "--drain-grace-s", "1")
        prefill, prefill_url = start_prefill("tcp")
        procs += [decode, prefill]
        router, url = start_router([prefill_url], [address])
        procs.append(router)
        signalled = []

        def drain():
            decode.send_signal(signal.SIGTERM)
            signalled.append(time.monotonic())

        _, error, _ = stream_long(url, 1500, drain)
        assert error is not None and error["code"] == 503, error
        assert time.monotonic() - signalled[0] < 15
        assert decode.wait(timeout=30) == 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.parametrize("backend", ["tcp", "shm", "mooncake", "nixl"])
def test_a_decode_server_restarted_on_its_address_serves_at_once(backend):
    procs = []
    try:
        decode, address = start_decode(backend)
        prefill, prefill_url = start_prefill(backend)
        procs += [decode, prefill]
        router, url = start_router([prefill_url], [address])
        procs.append(router)
        first = complete(url)
        assert first.status_code == 200, first.text
        decode.terminate()
        assert decode.wait(timeout=30) == 0
        port = address.rsplit(":", 1)[1]
        decode, again = start_decode(backend, "float32", "--grpc-port", port)
        procs.append(decode)
        assert again == address
        for _ in range(3):
            reply = complete(url)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
