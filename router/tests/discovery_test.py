"""router.discovery over the fakes: addresses a service name resolves to become instances
(probed), those it stops resolving to are removed, instances named on the command line stay, a
name that does not resolve changes nothing; and the real resolver."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from router.discovery import Discovery, instance_address, resolve, service
from router.orchestrator import Orchestrator
from router.tests.fakes import FakeDecode, FakePrefill

NAMED = "10.0.0.9:50051"


def _decodes(orchestrator: Orchestrator) -> dict[str, bool]:
    return {d.address: d.healthy for d in orchestrator.decodes}


def test_the_instances_follow_what_the_names_resolve_to():
    answers = {"decode.svc": ["10.0.0.1", "10.0.0.9"], "prefill.svc": ["10.0.0.5"]}

    async def resolver(host: str) -> list[str]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answers[host]

    decode = FakeDecode()
    orchestrator = Orchestrator(["http://p:8100"], [NAMED], FakePrefill(), decode)
    found = Discovery(orchestrator, ["decode.svc:50051"], ["http://prefill.svc:8100"], resolver)

    asyncio.run(found.refresh())
    assert _decodes(orchestrator) == {NAMED: True, "10.0.0.1:50051": True}
    assert ("Stats", "10.0.0.1:50051") in [(rpc, a) for rpc, a, _ in decode.calls]
    assert [p.url for p in orchestrator.prefills] == ["http://p:8100", "http://10.0.0.5:8100"]

    answers["decode.svc"] = ["10.0.0.2", "fd00::3"]  # 10.0.0.1 and the named one gone from DNS
    asyncio.run(found.refresh())
    assert set(_decodes(orchestrator)) == {NAMED, "10.0.0.2:50051", "[fd00::3]:50051"}

    del answers["decode.svc"]  # no ready pod behind the Service: nothing changes
    asyncio.run(found.refresh())
    assert set(_decodes(orchestrator)) == {NAMED, "10.0.0.2:50051", "[fd00::3]:50051"}


def test_the_real_resolver_and_malformed_services():
    assert "127.0.0.1" in asyncio.run(resolve("localhost"))
    assert service("decode", "decode.svc:50051") == ("", "decode.svc", 50051)
    assert instance_address("decode", "[fd00::3]:50051") == ("", "fd00::3", 50051)
    for text in ("decode.svc:99999", "a b:1", "decode.svc:50051/x", "user@decode.svc:1"):
        with pytest.raises(ValueError, match="is not host:port"):
            instance_address("decode", text)
    assert service("prefill", "http://prefill.svc:8100") == ("http", "prefill.svc", 8100)
    with pytest.raises(
        ValueError, match=re.escape("--decode-service: 'decode.svc' is not host:port")
    ):
        service("decode", "decode.svc")
    with pytest.raises(
        ValueError, match=re.escape("--prefill-service: 'prefill.svc:8100' is not http")
    ):
        service("prefill", "prefill.svc:8100")
