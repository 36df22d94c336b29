"""The stack across hosts of their own: network namespaces made by this test (as root) for the
router, the prefill and the decode server, each with its own address on a bridge, the test's
own host on it too; every server binds and advertises the address it is given. A completion
crosses all three (its KV over the tcp transport, prefill host to decode host); then the decode
host's link is cut mid-stream (`ip link set ... down`): the client gets an error event within
the gRPC keepalive's bound (rpc.keepalive) instead of waiting on a dead socket, the decode
server drops the request it can no longer deliver and frees its blocks, and once the link is
back the router serves again. The namespaces go at the end, and their links with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from rpc import keepalive
from tests.servers import COMMON, MODEL
from tools.launch import start

TAG = f"td{os.getpid() % 10000}"
SUBNET = f"10.{77 + os.getpid() % 100}.{os.getpid() % 250}"
HOSTS = {"router": 1, "prefill": 2, "decode": 3}
TEST_HOST = 254
DECODE_GRPC, DECODE_METRICS, PREFILL_PORT, ROUTER_PORT = 50051, 9100, 8100, 8000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _address(host: str) -> str:
    return f"{SUBNET}.{HOSTS[host]}"


def _link(host: str) -> str:
    """The switch's end of a host's link (at most 15 characters, as Linux wants)."""
    return f"{TAG}{host[0]}"


def _make_network() -> None:
    """A bridge in a namespace of its own (the switch), one namespace per host linked to it,
    and this process's host linked to it too."""
    switch = f"{TAG}-switch"
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    for host, number in HOSTS.items():
        ns = f"{TAG}-{host}"
        _ip("netns", "add", ns)
        _ip("link", "add", _link(host), "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", _link(host), "netns", switch)
        _ip("-n", switch, "link", "set", _link(host), "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{number}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    _ip("link", "add", f"{TAG}t", "type", "veth", "peer", "name", f"{TAG}t-h", "netns", switch)
    _ip("-n", switch, "link", "set", f"{TAG}t-h", "master", "br0", "up")
    _ip("addr", "add", f"{SUBNET}.{TEST_HOST}/24", "dev", f"{TAG}t")
    _ip("link", "set", f"{TAG}t", "up")


def _remove_network() -> None:
    """Each namespace, and with it the links it holds (and their peers)."""
    for name in (*HOSTS, "switch"):
        subprocess.run(["ip", "netns", "del", f"{TAG}-{name}"], capture_output=True)


def _cut(host: str, down: bool) -> None:
    _ip("-n", f"{TAG}-switch", "link", "set", _link(host), "down" if down else "up")


def _on(host: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", f"{TAG}-{host}")


@pytest.fixture(scope="module")
def stack():
    _make_network()
    procs = []
    try:
        decode, _ = start(
            ["decode.server", *COMMON, "--transport", "tcp", "--host", _address("decode"),
             "--grpc-port", str(DECODE_GRPC), "--metrics-port", str(DECODE_METRICS)],
            "serving gRPC on", prefix=_on("decode"),
        )  # fmt: skip
        procs.append(decode)
        prefill, _ = start(
            ["prefill.server", *COMMON, "--transport", "tcp", "--host", _address("prefill"),
             "--port", str(PREFILL_PORT)],
            "serving on", prefix=_on("prefill"),
        )  # fmt: skip
        procs.append(prefill)
        router, _ = start(
            ["router.server", "--model", MODEL, "--host", _address("router"),
             "--port", str(ROUTER_PORT), "--prefill", f"http://{_address('prefill')}:{PREFILL_PORT}",
             "--decode", f"{_address('decode')}:{DECODE_GRPC}"],
            "serving on", prefix=_on("router"),
        )  # fmt: skip
        procs.append(router)
        yield f"http://{_address('router')}:{ROUTER_PORT}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        _remove_network()


def _decode_metrics() -> dict[str, float]:
    """The decode server's tandem_decode_* gauges and counters, read on its own host (its
    link may be down)."""
    url = f"http://{_address('decode')}:{DECODE_METRICS}/metrics"
    code = f"import httpx; print(httpx.get({url!r}, timeout=10).text)"
    text = subprocess.run([*_on("decode"), sys.executable, "-c", code], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("tandem_decode_") and "{" not in line
    }


def _complete(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_completion_crosses_the_three_hosts(stack):
    before = _decode_metrics()["tandem_decode_transfer_bytes_total"]
    reply = _complete(stack)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    # The prompt's KV went from the prefill's host to the decode server's.
    assert _decode_metrics()["tandem_decode_transfer_bytes_total"] > before


def test_a_cut_link_ends_the_stream_with_an_error_and_frees_the_blocks(stack):
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    chunks, error = 0, None
    with httpx.stream("POST", f"{stack}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks += 1
            if chunks == 5:
                break
        assert chunks == 5
        _cut("decode", down=True)
        cut_at = time.monotonic()
        for line in lines:
            if line.startswith("data: {") and "error" in (event := json.loads(line[6:])):
                error = event["error"]
                break
        waited = time.monotonic() - cut_at
    assert error is not None and error["code"] == 503, error
    assert waited < keepalive.KEEPALIVE_S + keepalive.KEEPALIVE_TIMEOUT_S + 5, waited
    # The decode server cannot deliver to the router any more: its own keepalive ends the call,
    # the request is aborted and its blocks freed, while the link is still down.
    deadline = time.monotonic() + keepalive.KEEPALIVE_S + keepalive.KEEPALIVE_TIMEOUT_S + 10
    while time.monotonic() < deadline:
        metrics = _decode_metrics()
        if metrics["tandem_decode_running"] == 0:
            break
        time.sleep(1)
    assert metrics["tandem_decode_running"] == 0
    assert metrics["tandem_decode_kv_blocks_free"] == metrics["tandem_decode_kv_blocks_total"]
    _cut("decode", down=False)
    deadline = time.monotonic() + 60  # the router probes the decode server back
    while (reply := _complete(stack)).status_code != 200 and time.monotonic() < deadline:
        time.sleep(1)
    assert reply.status_code == 200, reply.text
