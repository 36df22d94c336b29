"""Requests a decode server prefills itself, over FakePrefill and FakeDecode: aggregated mode
sends every request straight to Generate with local_prefill (no Reserve, no prefill call); with
every prefill down, the decode-only fallback serves each request that way, counts it, logs the
change once each way, and a prefill probed back up takes the requests back. Every test ends
with the leak check: nothing in flight, no outstanding tokens, nothing left on the fake decode
server."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import generate_latest

from proto.tandem.v1 import decode_pb2
from router.generation import Finished, GenerationRequest, Tokens
from router.limiter import InFlightLimiter
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.tests.fakes import FakeDecode, FakePrefill, cancel_once, ids, logprob_of, refused

P0, P1 = "http://prefill-0", "http://prefill-1"
D0 = "decode-0:50051"
SAMPLING = decode_pb2.SamplingParams(temperature=0.5, logprobs=1)
REQUEST = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=8, sampling=SAMPLING, n=2,
                            stop_token_ids=(9,), ignore_eos=True)  # fmt: skip


def _stack(prefills=(P0, P1), **options) -> tuple[Orchestrator, FakePrefill, FakeDecode]:
    prefill, decode = FakePrefill(), FakeDecode()
    return Orchestrator(prefills, (D0,), prefill, decode, **options), prefill, decode


async def _generate(orchestrator: Orchestrator, request: GenerationRequest = REQUEST) -> list:
    return [item async for item in orchestrator.generate(request, "req")]


def _rpcs(decode: FakeDecode) -> list[str]:
    rpcs = [rpc for rpc, _, _ in decode.calls]
    decode.calls.clear()
    return rpcs


def _assert_idle(orchestrator: Orchestrator, decode: FakeDecode) -> None:
    assert all(p.in_flight == 0 for p in orchestrator.prefills)
    assert all(d.outstanding_tokens == 0 for d in orchestrator.decodes)
    assert decode.live() == set()


def _fallback_total(orchestrator: Orchestrator) -> float:
    text = generate_latest(RouterMetrics(orchestrator, InFlightLimiter(0)).registry).decode()
    (line,) = [x for x in text.splitlines() if x.startswith("tandem_router_decode_only_fallback")]
    return float(line.split()[-1])


def test_aggregated_sends_every_request_to_generate_with_the_prompt():
    orchestrator, prefill, decode = _stack(prefills=(), aggregated=True)
    items = asyncio.run(_generate(orchestrator))
    (generate,) = [request for _, _, request in decode.calls]
    assert generate.local_prefill == decode_pb2.LocalPrefill(prompt_token_ids=[1, 2, 3], n=2)
    assert (generate.generation, generate.first_token_id, list(generate.other_choices)) == (
        0, 0, [])  # fmt: skip
    assert generate.sampling == SAMPLING and generate.max_tokens == 8
    assert list(generate.stop_token_ids) == [9] and generate.ignore_eos
    assert items[0] == Tokens(ids("P"), [logprob_of(t) for t in ids("P")], index=0)
    assert items[-1] == Finished("length", 0, 5, index=1)
    assert prefill.calls == [] and orchestrator.decode_only.mode == "aggregated"
    assert _fallback_total(orchestrator) == 0
    _assert_idle(orchestrator, decode)


def test_with_every_prefill_down_requests_fall_back_until_one_is_probed_back(caplog):
    caplog.set_level(logging.WARNING, logger="router.decode_only")
    orchestrator, prefill, decode = _stack()
    prefill.script(P0, refused())
    prefill.script(P1, refused())
    served = asyncio.run(_generate(orchestrator))  # both tried, both down: this one falls back
    assert served[-1] == Finished("length", 0, 5, index=1)
    assert _rpcs(decode) == ["Reserve", "Abort", "Generate"]
    for _ in range(2):  # no prefill is tried any more
        assert asyncio.run(_generate(orchestrator)) == served
        assert _rpcs(decode) == ["Generate"]
    assert [c for c, _ in prefill.calls] == ["complete", "complete"]
    assert orchestrator.decode_only.mode == "decode-only fallback"
    assert _fallback_total(orchestrator) == 3
    asyncio.run(orchestrator.probe())  # both answer their health check again
    assert _rpcs(decode) == ["Stats"]  # the decode server's context length, not learnt yet
    assert asyncio.run(_generate(orchestrator))[-1] == served[-1]
    assert _rpcs(decode) == ["Reserve", "Generate"] and prefill.calls[-1] == ("complete", P0)
    assert orchestrator.decode_only.mode == "disaggregated"
    assert _fallback_total(orchestrator) == 3
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "no prefill instance is healthy: requests",
        "a prefill instance is healthy again: req",
    ]
    _assert_idle(orchestrator, decode)


def test_a_cancelled_consumer_of_a_local_prefill_aborts_it_on_the_decode_server():
    orchestrator, _, decode = _stack(prefills=(), aggregated=True)
    decode.stall = True

    cancel_once(decode.generating, _generate(orchestrator))
    (abort,) = decode.aborts()
    assert abort.reason == "client gone" and not abort.choices
    _assert_idle(orchestrator, decode)
