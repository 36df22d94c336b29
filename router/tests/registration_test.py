"""A server's registration with its routers (rpc/registration.py) against the router's admin
API served over HTTP (router/admin_api.py, its backends the fakes): a router that starts after
the server is registered with once it answers, one that has the address already counts as
registered, one that refuses (a wrong API key) is named and not asked again; withdrawing
deregisters from each router that has the server."""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import uvicorn

from prefill.vllm_launch import free_port
from router.tests.fakes import D0, Router
from rpc import registration
from rpc.registration import Registration

D1 = "127.0.0.1:50099"


class _Served:
    """A fakes Router's app on a loopback port, in a thread of its own."""

    def __init__(self, port: int, **router_args) -> None:
        self.router = Router(**router_args)
        config = uvicorn.Config(self.router.app, host="127.0.0.1", port=port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def decodes(self) -> list[str]:
        return [d.address for d in self.router.orchestrator.decodes]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _until(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(registration, "RETRY_S", 0.1)
    monkeypatch.delenv(registration.API_KEY_ENV, raising=False)


def test_a_router_that_starts_later_has_the_server_once_it_answers(capsys):
    port = free_port("127.0.0.1")
    member = Registration([f"http://127.0.0.1:{port}"], "decode", D1, "decode.server")
    member.start()
    time.sleep(0.3)
    assert "not reached" in capsys.readouterr().out  # nothing listens yet: asked again
    served = _Served(port)
    try:
        _until(lambda: D1 in served.decodes())
        member.withdraw()
        assert served.decodes() == [D0]
        out = capsys.readouterr().out
        assert f"registered with router http://127.0.0.1:{port} as {D1}" in out
        assert "deregistered from router" in out
    finally:
        served.close()


def test_an_address_the_router_has_already_counts_as_registered():
    served = _Served(free_port("127.0.0.1"))
    try:
        url = f"http://127.0.0.1:{served.server.config.port}"
        member = Registration([url], "decode", D0)  # on the router's command line already
        member.start()
        _until(lambda: member.registered == {url})
        member.withdraw()
        assert served.decodes() == []
    finally:
        served.close()


def test_a_refusal_is_named_and_not_asked_again(monkeypatch, capsys):
    served = _Served(free_port("127.0.0.1"), api_key="s3cret")
    try:
        url = f"http://127.0.0.1:{served.server.config.port}"
        member = Registration([url], "decode", D1)
        member.start()
        _until(lambda: "refused the registration: 401" in capsys.readouterr().out)
        time.sleep(0.3)
        assert "refused" not in capsys.readouterr().out  # not asked again
        assert served.decodes() == [D0] and member.registered == set()
        member.withdraw()  # nothing to deregister from
        monkeypatch.setenv(registration.API_KEY_ENV, "s3cret")
        keyed = Registration([url], "decode", D1)
        keyed.start()
        _until(lambda: D1 in served.decodes())
        keyed.withdraw()
        assert served.decodes() == [D0]
    finally:
        served.close()


def test_an_unspecified_bind_address_needs_an_advertised_one():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    registration.add_cli_args(parser)
    args = parser.parse_args(["--host", "0.0.0.0", "--register-with", "http://r:8000"])
    with pytest.raises(ValueError, match="give --advertise-address"):
        registration.check_args(args)
    args.advertise_address = "10.0.0.7:50051"
    registration.check_args(args)
    member = Registration.from_args(args, "decode", 50051, "decode.server")
    assert member.body == {"role": "decode", "address": "10.0.0.7:50051"}


def test_a_router_that_forgot_the_server_has_it_again(monkeypatch):
    """A restarted router has lost its registrations: the server, asking every CHECK_S
    whether it is listed, registers again."""
    monkeypatch.setattr(registration, "CHECK_S", 0.1)
    served = _Served(free_port("127.0.0.1"))
    try:
        member = Registration([f"http://127.0.0.1:{served.server.config.port}"], "decode", D1)
        member.start()
        _until(lambda: D1 in served.decodes())
        served.router.orchestrator.remove_instance("decode", D1)  # as a restart would
        _until(lambda: D1 in served.decodes())
        member.withdraw()
        assert served.decodes() == [D0]
    finally:
        served.close()


def test_an_aggregated_router_refuses_a_prefill_for_good(capsys):
    served = _Served(free_port("127.0.0.1"))
    served.router.orchestrator.decode_only.aggregated = True
    try:
        url = f"http://127.0.0.1:{served.server.config.port}"
        member = Registration([url], "prefill", "http://127.0.0.1:8199")
        member.start()
        _until(lambda: "refused the registration: 409" in capsys.readouterr().out)
        assert member.registered == set()
        member.withdraw()
    finally:
        served.close()
