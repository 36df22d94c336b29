"""The router's /admin/instances (router/admin_api.py) in-process over the fakes: instances
registered at runtime are probed and take requests, removed ones take no more, a removal
answers once no request is on its way to the instance (a Reserve, a prefill call), and bad
bodies, duplicates and unknown instances get OpenAI error bodies; the API key guards it as
/v1/*."""

from __future__ import annotations

import asyncio

import pytest

from router import admin_api
from router.tests.fakes import D0, MODEL, P0, Router, refused

D1, P1 = "decode-1:50051", "http://prefill-1:8100"
COMPLETION = {"model": MODEL, "prompt": "Capital?", "max_tokens": 8}


def _run(test, **router_args) -> None:
    router = Router(**router_args)
    asyncio.run(test(router))
    assert router.decode.live() == set()


async def _instances(router: Router) -> dict:
    return (await router.client.get("/admin/instances")).json()


async def _admin(router: Router, method: str, body, **kwargs):
    return await router.client.request(method, "/admin/instances", json=body, **kwargs)


def test_a_registered_decode_is_probed_and_takes_requests_and_a_removed_one_none():
    async def test(router: Router):
        reply = await _admin(router, "POST", {"role": "decode", "address": D1})
        assert reply.status_code == 201
        assert reply.json() == {"role": "decode", "address": D1, "status": "up"}
        assert ("Stats", D1) in [(rpc, address) for rpc, address, _ in router.decode.calls]
        assert (await _instances(router))["decode"] == {D0: "up", D1: "up"}
        reply = await _admin(router, "DELETE", {"role": "decode", "address": D0})
        assert reply.status_code == 200 and reply.json()["status"] == "removed"
        assert (await router.post("/v1/completions", COMPLETION)).status_code == 200
        generated = {address for rpc, address, _ in router.decode.calls if rpc == "Generate"}
        assert generated == {D1}
        assert (await _instances(router))["decode"] == {D1: "up"}

    _run(test)


async def _until(condition, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_removal_answers_once_no_request_is_on_its_way_to_the_instance(role):
    """A decode server's Reserve, a prefill's call: sent before the removal, unanswered; the
    DELETE answers after it (the instance may then refuse new work: nothing is coming)."""

    async def test(router: Router):
        gate = asyncio.Event()
        address = D0 if role == "decode" else P0
        if role == "decode":
            router.decode.reserve_gate = gate
            sent = lambda: ("Reserve", D0) in [(r, a) for r, a, _ in router.decode.calls]  # noqa: E731
        else:
            router.prefill.gate = gate
            sent = lambda: ("complete", P0) in router.prefill.calls  # noqa: E731
        completion = asyncio.create_task(router.post("/v1/completions", COMPLETION))
        await _until(sent)
        removal = asyncio.create_task(_admin(router, "DELETE", {"role": role, "address": address}))
        await asyncio.sleep(0.2)
        assert not removal.done()  # the request is still on its way
        assert (await _instances(router))[role] == {}  # but no new one goes there
        gate.set()
        reply = await removal
        assert reply.status_code == 200 and reply.json()["settled"] is True
        assert (await completion).status_code == 200  # served there

    _run(test)


def test_a_removal_that_cannot_settle_says_so_at_its_timeout(monkeypatch):
    monkeypatch.setattr(admin_api, "SETTLE_TIMEOUT_S", 0.2)

    async def test(router: Router):
        router.decode.reserve_gate = gate = asyncio.Event()
        completion = asyncio.create_task(router.post("/v1/completions", COMPLETION))
        await _until(lambda: router.orchestrator.decodes[0].arriving == 1)
        reply = await _admin(router, "DELETE", {"role": "decode", "address": D0})
        assert reply.status_code == 200 and reply.json()["settled"] is False
        gate.set()
        assert (await completion).status_code == 200

    _run(test)


def test_a_prefill_that_does_not_answer_is_kept_down_until_it_does():
    async def test(router: Router):
        router.prefill.up[P1] = False
        reply = await _admin(router, "POST", {"role": "prefill", "address": P1})
        assert reply.status_code == 201 and reply.json()["status"] == "down"
        router.prefill.up[P1] = True
        await router.orchestrator.probe()
        assert (await _instances(router))["prefill"] == {P0: "up", P1: "up"}

    _run(test)


def test_bad_bodies_duplicates_and_unknown_instances_are_refused_by_name():
    async def test(router: Router):
        cases = [
            ("POST", {"role": "decode", "address": D0}, 409, "address", "registered already"),
            ("DELETE", {"role": "prefill", "address": P1}, 404, "address", "not registered"),
            ("POST", {"role": "router", "address": D1}, 400, "role", "'router'"),
            ("POST", {"role": "decode", "address": "decode-1"}, 400, "address", "host:port"),
            ("POST", {"role": "prefill", "address": "prefill-1:8100"}, 400, "address", "http"),
            ("POST", {"role": "decode"}, 400, "address", "None"),
            ("POST", ["decode", D1], 400, None, "JSON object"),
        ]
        for method, body, status, param, words in cases:
            reply = await _admin(router, method, body)
            error = reply.json()["error"]
            assert reply.status_code == status and error["code"] == status, (body, error)
            assert error["param"] == param and words in error["message"], (body, error)
        for body in (b"{", b"[" * 100000):  # too deep for Python's parser: no 500 either
            reply = await router.client.post("/admin/instances", content=body)
            assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
        assert (await _instances(router)) == {"prefill": {P0: "up"}, "decode": {D0: "up"}}

    _run(test)


def test_the_api_key_guards_the_admin_api():
    async def test(router: Router):
        body = {"role": "decode", "address": D1}
        assert (await _admin(router, "POST", body)).status_code == 401
        assert (await router.client.get("/admin/instances")).status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert (await _admin(router, "POST", body, headers=key)).status_code == 201

    _run(test, api_key="s3cret")


def test_a_prefill_removed_while_another_is_asked_gets_no_retry():
    async def test(router: Router):
        assert (await _admin(router, "POST", {"role": "prefill", "address": P1})).status_code == 201
        router.prefill.gate = gate = asyncio.Event()
        router.prefill.script(P0, refused())  # the first one asked fails: a retry is due
        completion = asyncio.create_task(router.post("/v1/completions", COMPLETION))
        await _until(lambda: ("complete", P0) in router.prefill.calls)
        removal = await _admin(router, "DELETE", {"role": "prefill", "address": P1})
        assert removal.json()["settled"] is True  # nothing was on its way to P1
        gate.set()
        await completion
        assert ("complete", P1) not in router.prefill.calls

    _run(test)
