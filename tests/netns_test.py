"""The stack across hosts of their own: network namespaces made by this test (as root) for the
router, two prefill and two decode servers, each with its own address on a bridge, the test's
own host on it too; every server binds and advertises the address it is given. Greedy
completions across them (their KV over the tcp transport, and over Mooncake's TCP, prefill
hosts to decode hosts) equal the same stack's on one host's loopback. Then the link of the
decode host serving a stream is cut mid-stream (`ip link set ... down`): the client gets an
error event within the gRPC keepalive's bound (rpc.keepalive) instead of waiting on a dead
socket, the other decode host goes on serving, the cut one drops the request it can no longer
deliver and frees its blocks, and once the link is back the router serves through it again.
The namespaces go at the end, and their links with them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rpc import keepalive
from tests.netns import Network
from tests.servers import COMMON, MODEL, complete, running_backends, start_router, stream_long
from tools.launch import start

HOSTS = {"router": 1, "prefill0": 2, "prefill1": 3, "decode0": 4, "decode1": 5}
DECODES = ("decode0", "decode1")
DECODE_GRPC, DECODE_METRICS, PREFILL_PORT, ROUTER_PORT = 50051, 9100, 8100, 8000
NETWORK = Network("td", HOSTS)
_address, _on = NETWORK.address, NETWORK.on


@pytest.fixture(scope="module", params=["tcp", "mooncake"])
def stack(request):
    """The five hosts' stack over the KV transport `request.param`: (router URL, transport)."""
    transport = request.param
    NETWORK.make()
    procs = []
    try:
        for host in DECODES:
            proc, _ = start(
                ["decode.server", *COMMON, "--transport", transport, "--host", _address(host),
                 "--grpc-port", str(DECODE_GRPC), "--metrics-port", str(DECODE_METRICS)],
                "serving gRPC on", prefix=_on(host),
            )  # fmt: skip
            procs.append(proc)
        router_args = ["router.server", "--model", MODEL, "--host", _address("router"),
                       "--port", str(ROUTER_PORT)]  # fmt: skip
        for host in ("prefill0", "prefill1"):
            proc, _ = start(
                ["prefill.server", *COMMON, "--transport", transport, "--host", _address(host),
                 "--port", str(PREFILL_PORT)],
                "serving on", prefix=_on(host),
            )  # fmt: skip
            procs.append(proc)
            router_args += ["--prefill", f"http://{_address(host)}:{PREFILL_PORT}"]
        router_args += [f"--decode={_address(host)}:{DECODE_GRPC}" for host in DECODES]
        router, _ = start(router_args, "serving on", prefix=_on("router"))
        procs.append(router)
        yield f"http://{_address('router')}:{ROUTER_PORT}", transport
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        NETWORK.remove()


def _decode_metrics(host: str) -> dict[str, float]:
    """A decode server's tandem_decode_* gauges and counters, read on its own host (its link
    may be down)."""
    url = f"http://{_address(host)}:{DECODE_METRICS}/metrics"
    code = f"import httpx; print(httpx.get({url!r}, timeout=10).text)"
    text = subprocess.run([*_on(host), sys.executable, "-c", code], check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("tandem_decode_")  # labelled ones keyed with their labels
    }


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Count to ten:", "Once upon a"]


def _texts(url: str) -> list[str]:
    replies = [complete(url, prompt) for prompt in PROMPTS]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["text"] for r in replies]


def _transferred() -> float:
    return sum(
        value
        for h in DECODES
        for name, value in _decode_metrics(h).items()
        if name.startswith("tandem_decode_transfer_bytes_total")
    )


def test_completions_across_five_hosts_equal_the_one_host_stack(stack):
    url, transport = stack
    before = _transferred()
    texts = _texts(url)
    assert _transferred() > before  # prompts' KV went from prefill hosts to decode hosts
    with running_backends(transport) as (prefill_urls, decode_addresses):
        router, one_host = start_router(prefill_urls, decode_addresses)
        try:
            assert texts == _texts(one_host)
        finally:
            router.terminate()
            router.wait(timeout=30)


def _serving() -> str:
    """The decode host running the one stream in flight."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = [h for h in DECODES if _decode_metrics(h)["tandem_decode_running"] > 0]
        if running:
            return running[0]
        time.sleep(0.2)
    raise AssertionError("no decode host runs the stream")


def test_a_cut_link_ends_the_stream_with_an_error_and_frees_the_blocks(stack):
    stack, _ = stack
    cuts = []  # the decode host whose link was cut, and when

    def cut_the_serving_host():
        host = _serving()
        NETWORK.cut(host, down=True)
        cuts.append((host, time.monotonic()))

    _, error, _ = stream_long(stack, 2000, cut_the_serving_host)
    assert cuts, "the stream ended before its fifth chunk"
    cut, waited = cuts[0][0], time.monotonic() - cuts[0][1]
    assert error is not None and error["code"] == 503, error
    assert waited < keepalive.KEEPALIVE_S + keepalive.KEEPALIVE_TIMEOUT_S + 5, waited
    # The other decode host serves meanwhile.
    assert complete(stack).status_code == 200
    # The cut one cannot deliver to the router any more: its own keepalive ends the call, the
    # request is aborted and its blocks freed, while the link is still down.
    deadline = time.monotonic() + keepalive.KEEPALIVE_S + keepalive.KEEPALIVE_TIMEOUT_S + 10
    while time.monotonic() < deadline:
        metrics = _decode_metrics(cut)
        if metrics["tandem_decode_running"] == 0:
            break
        time.sleep(1)
    assert metrics["tandem_decode_running"] == 0
    assert metrics["tandem_decode_kv_blocks_free"] == metrics["tandem_decode_kv_blocks_total"]
    NETWORK.cut(cut, down=False)
    # The router probes it back: two requests at once go to the two hosts (least loaded).
    served = _decode_metrics(cut)["tandem_decode_tokens_generated_total"]
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(2) as pool:
        while _decode_metrics(cut)["tandem_decode_tokens_generated_total"] == served:
            assert time.monotonic() < deadline, "the router never routed to the restored host"
            replies = list(pool.map(complete, [stack, stack]))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
