"""A rolling restart under load, with real processes (the bundled SmolLM2 on the CPU, over tcp):
two decode and two prefill servers behind the router serve 8 clients asking for greedy
completions back to back, while each server in turn is sent SIGTERM (it deregisters from the
router, which answers once nothing it sent is on its way there; then it drains: a decode server
refuses new requests and finishes its streams, a prefill server stops taking requests and
finishes the ones it has), exits 0, and is started again on its address, registering itself,
the next one only once the router has it back. Not one request fails, every answer is the same
text, no server refused a request while draining (the router never sent one to a draining
server), and both decode servers end with their block pools all free.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx

from prefill.vllm_launch import free_port
from tests.servers import (
    MODEL,
    decode_pool_free,
    exit_line,
    start_decode,
    start_prefill,
    start_router,
)

CLIENTS = 8
PROMPT = "The capital of France is"


def _ask(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _router_has(url: str, role: str, address: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health.get(role, {}).get(address) == "up":
            return
        time.sleep(0.2)
    raise AssertionError(f"the router did not take {role} {address} back in {timeout} s")


def test_draining_and_restarting_every_server_in_turn_fails_no_request():
    procs: dict[str, object] = {}
    port = free_port("127.0.0.1")
    # Each server registers itself (the router, started after them, has them already: 409).
    register = ("--register-with", f"http://127.0.0.1:{port}")
    try:
        decodes, prefills = [], []  # the addresses the servers picked: each restarts on its own
        for i in range(2):
            procs[f"decode{i}"], address = start_decode(
                "tcp", "float32", "--drain-grace-s", "30", *register
            )
            decodes.append(address)
            procs[f"prefill{i}"], prefill_url = start_prefill("tcp", 0, *register)
            prefills.append(prefill_url)
        procs["router"], url = start_router(prefills, decodes, "--port", str(port))
        expected = _ask(url)
        assert expected.status_code == 200, expected.text
        text = expected.json()["choices"][0]["text"]

        stop, answers, failures = threading.Event(), [], []

        def client() -> None:
            while not stop.is_set():
                reply = _ask(url)
                if reply.status_code != 200:
                    failures.append(f"{reply.status_code}: {reply.text[:300]}")
                else:
                    answers.append(reply.json()["choices"][0]["text"])

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(2)
            for name, role, address in [
                ("decode0", "decode", decodes[0]), ("prefill0", "prefill", prefills[0]),
                ("decode1", "decode", decodes[1]), ("prefill1", "prefill", prefills[1]),
            ]:  # fmt: skip
                served = len(answers)
                procs[name].send_signal(signal.SIGTERM)
                assert procs[name].wait(timeout=60) == 0, f"{name} did not drain cleanly"
                stopped = exit_line(procs[name], r"stopped, (\d+) .* (\d+) refused while draining")
                assert stopped.groups() == ("0", "0"), stopped.group(0)
                own = address.rsplit(":", 1)[1]
                if role == "decode":
                    procs[name], again = start_decode(
                        "tcp", "float32", "--drain-grace-s", "30", "--grpc-port", own, *register
                    )
                else:
                    procs[name], again = start_prefill("tcp", int(own), *register)
                assert again == address
                _router_has(url, role, address)
                assert len(answers) > served  # the others served meanwhile
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
        assert failures == []
        assert len(answers) >= 4 * CLIENTS and set(answers) == {text}
        for address in decodes:
            assert decode_pool_free(address) is not None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
