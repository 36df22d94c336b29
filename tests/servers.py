"""Starting tandem's servers as a user would, for the integration suites."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time

import grpc
import httpx

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tools.launch import start

MODEL = "tools/smollm2-135m-instruct"  # Bazel data: //tools:smollm2
COMMON = ["--model", MODEL, "--dtype", "float32", "--block-size", "16", "--kv-cache-gb", "0.1"]


_METRICS: dict[str, str] = {}
"""gRPC address of every decode server started -> its Prometheus /metrics URL."""


def start_decode(backend: str, dtype: str = "float32", *extra: str) -> tuple[subprocess.Popen, str]:
    """A decode server, its metrics served too (`metrics_url`): (process, gRPC address)."""
    args = list(COMMON)
    args[args.index("--dtype") + 1] = dtype
    proc, m = start(
        ["decode.server", *args, "--transport", backend, "--grpc-port", "0",
         "--metrics-port", "0", *extra],
        r"serving gRPC on [\d.]+:(\d+), metrics on :(\d+)",
    )  # fmt: skip
    address = f"127.0.0.1:{m.group(1)}"
    _METRICS[address] = f"http://127.0.0.1:{m.group(2)}/metrics"
    return proc, address


def exit_line(proc: subprocess.Popen, pattern: str, timeout: float = 10) -> re.Match:
    """The match of `pattern` in what an exited server (tools.launch.start's) said last."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(proc.last_lines):
            if match := re.search(pattern, line):
                return match
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in: {''.join(proc.last_lines)}")


def metrics_url(decode_address: str) -> str:
    """The /metrics URL of the decode server started at `decode_address`."""
    return _METRICS[decode_address]


def counter(url: str, name: str) -> float:
    """The value of a Prometheus counter at /metrics `url` (summed over its label sets)."""
    text = httpx.get(url, timeout=10).text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))


def start_prefill(backend: str, port: int = 0, *extra: str) -> tuple[subprocess.Popen, str]:
    """A prefill server on `port` (0: one the OS picks; a port: e.g. a stopped one's again);
    `extra` arguments override COMMON's."""
    proc, m = start(
        ["prefill.server", *COMMON, "--transport", backend, "--port", str(port), *extra],
        r"serving on (http://[\d.:]+)",
    )
    return proc, m.group(1)


def start_router(prefill_urls: list[str], decode_addresses: list[str], *extra: str):
    args = ["router.server", "--model", MODEL, "--port", "0", *extra]
    for url in prefill_urls:
        args += ["--prefill", url]
    for address in decode_addresses:
        args += ["--decode", address]
    proc, m = start(args, r"serving on (http://[\d.:]+)")
    return proc, m.group(1)


def stop(*procs: subprocess.Popen) -> None:
    """Terminates each process still running (it drains, as on SIGTERM) and waits for it."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


@contextlib.contextmanager
def running_backends(backend: str = "tcp"):
    """A decode and a prefill server over `backend`: ([prefill URL], [decode address]); both
    stopped at the end."""
    decode, address = start_decode(backend)
    prefill, prefill_url = start_prefill(backend)
    try:
        yield [prefill_url], [address]
    finally:
        for proc in (prefill, decode):
            proc.terminate()
            proc.wait(timeout=10)


@contextlib.contextmanager
def running_router(prefill_urls: list[str], decode_addresses: list[str], *extra: str):
    """A router in front of them: its URL; stopped at the end."""
    proc, url = start_router(prefill_urls, decode_addresses, *extra)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def serving_decode(config):
    """A decode server in this process (decode.server.DecodeServer of `config`) and a gRPC stub
    of it: (server, stub); stopped at the end."""
    from decode.server import DecodeServer  # the engine: only for the tests that want it here

    server = DecodeServer(config)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, decode_pb2_grpc.DecodeServiceStub(channel)
    finally:
        channel.close()
        server.stop()


def complete(url: str, prompt: str = "The capital of France is") -> httpx.Response:
    """A greedy completion of 8 tokens through the router at `url`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def stream_long(url: str, max_tokens: int, on_fifth_chunk) -> tuple[int, dict | None, str | None]:
    """Streams a long greedy completion (ignore_eos) through the router at `url`, calling
    on_fifth_chunk() once when its fifth chunk came: (text chunks, the error event if one came,
    the finish reason)."""
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    chunks, error, finish = 0, None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                break
            chunks += 1
            finish = event["choices"][0]["finish_reason"] or finish
            if chunks == 5:
                on_fifth_chunk()
    return chunks, error, finish


def decode_pool_free(address: str, within: float = 5.0) -> decode_pb2.StatsResponse | None:
    """The decode server's Stats once its KV pool is all free and nothing is reserved (within
    `within` seconds: frees may trail a reply); None if that never happens."""
    deadline = time.monotonic() + within
    with grpc.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        while True:
            stats = stub.Stats(decode_pb2.StatsRequest(), timeout=5)
            if stats.kv_blocks_free == stats.kv_blocks_total and not stats.reserved:
                return stats
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)


class PeakRunning:
    """The largest running batch a decode server reports while the `with` block runs, polled
    every 5 ms: requests sent together must decode as a batch, not one at a time."""

    def __init__(self, stub: decode_pb2_grpc.DecodeServiceStub) -> None:
        self.stub = stub
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def __enter__(self) -> PeakRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.stub.Stats(decode_pb2.StatsRequest()).running)
            time.sleep(0.005)
