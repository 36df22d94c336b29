"""A server's membership in its routers (router/admin_api.py): registered once it serves, and
deregistered before it drains, so that no router sends it a request it would refuse.

    registration = Registration(["http://router:8000"], "decode", "10.0.0.7:50051")
    registration.start()      # in the background, until each router has it
    ...                       # SIGTERM:
    registration.withdraw()   # each router answers once nothing is on its way here
    server.drain()            # only now refuse new work

A router that cannot be reached yet is asked again every RETRY_S (routers and servers start in
any order), and one that has the server is asked every CHECK_S whether it still does (a
restarted router has forgotten it); one that refuses the registration (a bad address, a wrong
API key, an aggregated router and a prefill) is named in the log and not asked again. The API
key is the environment's TANDEM_ROUTER_API_KEY, never a command-line argument (which other
users of the host can read).
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

API_KEY_ENV = "TANDEM_ROUTER_API_KEY"
PATH = "/admin/instances"
RETRY_S = 2.0
CHECK_S = 10.0
"""How often a router that has this server is asked whether it still has it."""
CALL_TIMEOUT_S = 5.0
WITHDRAW_TIMEOUT_S = 40.0
"""Longer than a router waits for the requests on their way here (its SETTLE_TIMEOUT_S)."""
UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--register-with", action="append", default=[], metavar="ROUTER_URL",
                        help="a router to register with once serving, and to deregister from "
                        "before draining (API key: $" + API_KEY_ENV + ")")  # fmt: skip
    parser.add_argument("--advertise-address", default=None,
                        help="the address routers reach this server at (default: --host and "
                        "the port it serves on)")  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """ValueError when routers are given but no address they could reach: the server binds
    every interface and no --advertise-address says which."""
    if args.register_with and args.advertise_address is None and args.host in UNSPECIFIED_HOSTS:
        raise ValueError(
            f"--register-with: --host {args.host!r} is no address a router can reach; give "
            "--advertise-address"
        )


class Registration:
    def __init__(
        self, routers: Sequence[str], role: str, address: str, server: str = "server"
    ) -> None:
        """`address`: what the routers reach this server at (a decode server's host:port, a
        prefill's http://host:port); `server`: the name its log lines start with."""
        self.server = server
        self.routers = [router.rstrip("/") for router in routers]
        self.body = {"role": role, "address": address}
        key = os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.registered: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._register_loop, daemon=True)

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str, port: int, server: str) -> Registration:
        """From `add_cli_args`' flags (checked by `check_args`) and the port the server got."""
        address = args.advertise_address
        if address is None:
            host = args.host
            address = f"{host}:{port}" if role == "decode" else f"http://{host}:{port}"
        return cls(args.register_with, role, address, server)

    def start(self) -> None:
        if self.routers:
            self._thread.start()

    def withdraw(self) -> None:
        """Stops registering and deregisters from every router that has this server, all at
        once; returns once each has answered (it waits for the requests on their way here) or
        could not be reached."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            routers = sorted(self.registered)
        if routers:
            with ThreadPoolExecutor(len(routers)) as pool:
                list(pool.map(self._deregister, routers))

    def _register_loop(self) -> None:
        """Until withdrawn: each router that does not list this server is asked to; every
        RETRY_S while one could not be reached, else every CHECK_S (a router restarted has
        forgotten its registrations)."""
        refused: set[str] = set()
        while not self._stop.is_set():
            outcomes = {r: self._ensure(r) for r in self.routers if r not in refused}
            refused |= {router for router, outcome in outcomes.items() if outcome == "refused"}
            unreached = any(outcome == "unreached" for outcome in outcomes.values())
            self._stop.wait(RETRY_S if unreached else CHECK_S)

    def _ensure(self, router: str) -> str:
        """ "listed" (the router has this server), "refused" (for good) or "unreached"."""
        try:
            if self._listed(router):
                return "listed"
            reply = httpx.post(
                router + PATH, json=self.body, headers=self.headers, timeout=CALL_TIMEOUT_S
            )
        except httpx.HTTPError as e:
            self._log(f"router {router} not reached ({e}); registering again in {RETRY_S} s")
            return "unreached"
        # 409 naming the address: it has this address already (e.g. on its command line).
        if reply.status_code == 201 or _error_param(reply) == (409, "address"):
            with self._lock:
                self.registered.add(router)
            self._log(f"registered with router {router} as {self.body['address']}")
            return "listed"
        if reply.status_code >= 500:
            return "unreached"
        self._log(f"router {router} refused the registration: {reply.status_code} "
                  f"{reply.text[:300]}")  # fmt: skip
        return "refused"

    def _listed(self, router: str) -> bool:
        """Whether the router lists this server (as registered here or on its command line)."""
        reply = httpx.get(router + PATH, headers=self.headers, timeout=CALL_TIMEOUT_S)
        try:
            listed = reply.status_code == 200 and self.body["address"] in reply.json().get(
                self.body["role"], {}
            )
        except ValueError:
            return False
        if listed:
            with self._lock:
                self.registered.add(router)
        return listed

    def _deregister(self, router: str) -> None:
        try:
            reply = httpx.request("DELETE", router + PATH, json=self.body, headers=self.headers,
                                  timeout=WITHDRAW_TIMEOUT_S)  # fmt: skip
        except httpx.HTTPError as e:
            self._log(f"router {router} not reached to deregister ({e})")
            return
        if reply.status_code != 200:
            self._log(f"router {router}: deregistration answered {reply.status_code} "
                      f"{reply.text[:300]}")  # fmt: skip
        elif not reply.json().get("settled", True):
            self._log(f"deregistered from router {router}; requests were still on their way")
        else:
            self._log(f"deregistered from router {router}")

    def _log(self, line: str) -> None:
        print(f"{self.server}: {line}", flush=True)


def _error_param(reply: httpx.Response) -> tuple[int, str | None]:
    """(status, the OpenAI error body's `param`)."""
    try:
        param = reply.json().get("error", {}).get("param")
    except (ValueError, AttributeError):
        param = None
    return reply.status_code, param
