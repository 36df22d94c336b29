"""Orchestrator.tokenize over prefill instances answering through httpx's in-process transport."""

import asyncio

import httpx
import pytest

from router.orchestrator import BackendError, Orchestrator, PrefillInstance


def _prefill(url: str, status: int, asked: list[str]) -> PrefillInstance:
    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(url)
        if status == 200:
            return httpx.Response(200, json={"tokens": [1, 2, 3], "count": 3})
        return httpx.Response(status, text=f"{url} says no")

    client = httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(answer))
    return PrefillInstance(url, client)


def _tokenize(statuses: list[int]) -> tuple[list[int] | BackendError, list[str], Orchestrator]:
    asked: list[str] = []
    orchestrator = Orchestrator([], [])
    orchestrator.prefills = [
        _prefill(f"http://prefill-{i}", status, asked) for i, status in enumerate(statuses)
    ]

    async def run():
        try:
            return await orchestrator.tokenize({"prompt": "hi"})
        except BackendError as e:
            return e
        finally:
            await orchestrator.close()

    return asyncio.run(run()), asked, orchestrator


def test_a_server_error_is_retried_on_the_other_prefill():
    result, asked, orchestrator = _tokenize([503, 200])
    assert result == [1, 2, 3]
    assert asked == ["http://prefill-0", "http://prefill-1"]
    assert all(p.in_flight == 0 for p in orchestrator.prefills)


def test_a_refused_request_is_not_retried():
    result, asked, _ = _tokenize([400, 200])
    assert isinstance(result, BackendError) and result.status == 400
    assert "prefill-0" in str(result) and "says no" in str(result)
    assert asked == ["http://prefill-0"]


@pytest.mark.parametrize("statuses", [[500, 502], [500]], ids=["two", "one"])
def test_every_prefill_failing_is_a_503_naming_the_last(statuses):
    result, asked, orchestrator = _tokenize(statuses)
    assert isinstance(result, BackendError) and result.status == 503
    assert f"prefill-{len(statuses) - 1}" in str(result)
    assert len(asked) == len(statuses)
    assert all(p.in_flight == 0 for p in orchestrator.prefills)
