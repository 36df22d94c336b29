"""Instances found by DNS: a name that resolves to many addresses (a Kubernetes headless
Service, a round-robin record), re-resolved every REFRESH_S seconds. An address that appears is
registered (Orchestrator.add_instance: probed, and taking requests once it answers); one that
disappears is removed (no new requests; those it runs finish). Instances named on the command
line are never removed by discovery. A name that does not resolve (the Service has no ready pod
yet) changes nothing and is logged.

    --decode-service decode.tandem.svc.cluster.local:50051
    --prefill-service http://prefill.tandem.svc.cluster.local:8100
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from router.orchestrator import Orchestrator

REFRESH_S = 10.0
log = logging.getLogger("router.discovery")

Resolve = Callable[[str], Awaitable[list[str]]]
"""A host name -> its IP addresses."""


async def resolve(host: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def instance_address(role: str, text: str) -> tuple[str, str, int]:
    """(scheme or "", host, port) of an instance's address: a decode server's host:port, a
    prefill's http(s)://host:port (a name or an IP; IPv6 in brackets); ValueError saying which
    form `text` is not. Registered addresses (router.admin_api) and service names alike."""
    form = "http(s)://host:port" if role == "prefill" else "host:port"
    schemes = ("http", "https") if role == "prefill" else ("",)
    try:
        parts = urlsplit(text if role == "prefill" else f"//{text}")
        valid = (
            parts.scheme in schemes
            and bool(parts.hostname)
            and parts.port is not None  # (raises ValueError past 65535 or not a number)
            and not (parts.path or parts.query or parts.fragment or parts.username)
            and not any(c.isspace() for c in text)
        )
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(f"{text!r} is not {form}")
    return parts.scheme, parts.hostname, parts.port


def service(role: str, spec: str) -> tuple[str, str, int]:
    """`instance_address` of a --decode-service or --prefill-service; ValueError naming the
    flag otherwise."""
    try:
        return instance_address(role, spec)
    except ValueError as e:
        raise ValueError(f"--{role}-service: {e}") from None


class Discovery:
    def __init__(
        self,
        orchestrator: Orchestrator,
        decode_services: Sequence[str] = (),
        prefill_services: Sequence[str] = (),
        resolver: Resolve = resolve,
    ) -> None:
        self.orchestrator = orchestrator
        self.services = [("decode", service("decode", s)) for s in decode_services]
        self.services += [("prefill", service("prefill", s)) for s in prefill_services]
        self.resolver = resolver
        self._owned: dict[tuple[str, str], set[str]] = {}
        """(role, service) -> the instances discovery registered for it (and may remove)."""

    async def refresh(self) -> None:
        """Resolves every service once, registering and removing instances to match."""
        for role, (scheme, host, port) in self.services:
            try:
                ips = await self.resolver(host)
            except OSError as e:
                log.warning("%s service %s does not resolve (%s): instances unchanged", role,
                            host, e)  # fmt: skip
                continue
            found = {_address(scheme, ip, port) for ip in ips}
            owned = self._owned.setdefault((role, host), set())
            for address in sorted(found - owned):
                if self.orchestrator.add_instance(role, address):  # else named already
                    owned.add(address)
                    log.info("%s %s found (%s)", role, address, host)
            for address in sorted(owned - found):
                self.orchestrator.remove_instance(role, address)
                owned.discard(address)
                log.info("%s %s gone from %s", role, address, host)
        await self.orchestrator.probe()

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.refresh()


def _address(scheme: str, ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"{scheme}://{host}:{port}" if scheme else f"{host}:{port}"
