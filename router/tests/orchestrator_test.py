"""The Orchestrator over FakePrefill and FakeDecode: placement, the prefill retry, aborts (client
gone, prefill failed, ticket never delivered), instances marked down and probed back up, and how
decode RPC failures become HTTP statuses. Every test ends with the leak check: nothing in
flight, no outstanding tokens, no reservation left on the fake decode server."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from proto.tandem.v1 import decode_pb2
from router.errors import BackendError
from router.generation import Finished, GenerationRequest, PromptLogprobs, Tokens
from router.orchestrator import Orchestrator, PrefillFailed
from router.prefix_affinity import PlacedBlocks
from router.tests.fakes import (
    FakeDecode,
    FakePrefill,
    answer,
    cancel_once,
    dropped,
    ids,
    logprob_of,
    prompt_logprob_of,
    refused,
    rpc_error,
)

P0, P1 = "http://prefill-0", "http://prefill-1"
D0, D1 = "decode-0:50051", "decode-1:50051"
REQUEST = GenerationRequest(
    prompt_ids=[1, 2, 3], max_tokens=8, sampling=decode_pb2.SamplingParams(temperature=0.5)
)


def _stack(
    prefills=(P0, P1), decodes=(D0,), **options
) -> tuple[Orchestrator, FakePrefill, FakeDecode]:
    prefill, decode = FakePrefill(), FakeDecode()
    return Orchestrator(prefills, decodes, prefill, decode, **options), prefill, decode


async def _generate(orchestrator: Orchestrator, request: GenerationRequest = REQUEST) -> list:
    """Every item, then the BackendError that ended the stream, if one did."""
    items = []
    try:
        async for item in orchestrator.generate(request, "req"):
            items.append(item)
    except BackendError as e:
        items.append(e)
    return items


def _assert_idle(orchestrator: Orchestrator, decode: FakeDecode) -> None:
    assert all(p.in_flight == 0 for p in orchestrator.prefills)
    assert all(d.outstanding_tokens == d.active_tokens == 0 for d in orchestrator.decodes)
    assert decode.live() == set(), "a reservation was neither generated, failed nor aborted"


def _health(orchestrator: Orchestrator) -> dict[str, bool]:
    return {i.url: i.healthy for i in orchestrator.prefills} | {
        i.address: i.healthy for i in orchestrator.decodes
    }


def test_a_request_is_reserved_prefilled_with_the_ticket_and_generated():
    orchestrator, prefill, decode = _stack()
    items = asyncio.run(_generate(orchestrator))
    assert items == [Tokens(ids("P")), Tokens(ids("ar")), Tokens(ids("is")),
                     Finished("length", 0, 5)]  # fmt: skip
    (reserve, generate) = [request for rpc, _, request in decode.calls]
    (prefilled,) = prefill.prefilled
    assert prefilled.url == P0 and prefilled.prompt_ids == REQUEST.prompt_ids
    assert prefilled.transfer.decode_address == D0
    assert prefilled.transfer.ticket.request_id == reserve.request_id == generate.request_id
    assert generate.generation == prefilled.transfer.ticket.generation
    assert generate.first_token_id == prefill.first_token
    assert generate.sampling == prefilled.sampling == REQUEST.sampling
    assert reserve.max_tokens == generate.max_tokens == REQUEST.max_tokens
    _assert_idle(orchestrator, decode)


def test_the_decode_with_fewest_outstanding_tokens_is_picked():
    orchestrator, _, decode = _stack(decodes=(D0, D1))
    orchestrator.decodes[0].outstanding_tokens = 100
    asyncio.run(_generate(orchestrator))
    assert {address for _, address, _ in decode.calls} == {D1}
    orchestrator.decodes[0].outstanding_tokens = 0
    _assert_idle(orchestrator, decode)


def _placed_on(orchestrator, decode: FakeDecode, prompt_ids: list[int]) -> str:
    """The address the request for `prompt_ids` was reserved on."""
    calls = len(decode.calls)
    request = dataclasses.replace(REQUEST, prompt_ids=prompt_ids)
    asyncio.run(_generate(orchestrator, request))
    return next(address for rpc, address, _ in decode.calls[calls:] if rpc == "Reserve")


def test_a_prompt_goes_where_the_fewest_tokens_are_in_hand_once_it_holds_it():
    # Among decode servers caching prefixes: the prompt's tokens a server does not hold (as
    # far as the router placed them) plus the KV tokens already placed there.
    orchestrator, _, decode = _stack(decodes=(D0, D1))
    decode.prefix_caching = True
    asyncio.run(orchestrator.probe())  # their block size and caching
    d0, d1 = orchestrator.decodes
    turn = list(range(100, 140))  # 40 tokens: two full blocks a server could reuse
    d0.active_tokens = 100
    assert _placed_on(orchestrator, decode, turn) == D1  # 40 to D1's 140
    # D1 holds 32 of the next turn's 50 tokens: 18 + 20 placed there beat D0's 50.
    d0.active_tokens, d1.active_tokens = 0, 20
    next_turn = turn + list(range(500, 520))
    assert _placed_on(orchestrator, decode, next_turn) == D1
    # Busier than what it holds saves: D0.
    d1.active_tokens = 100
    assert _placed_on(orchestrator, decode, next_turn + [7] * 10) == D0
    # A server restarted on its address has an empty cache: nothing of it is remembered.
    d1.active_tokens = 20
    decode.instance_id = "decode-instance-2"
    asyncio.run(orchestrator.probe())
    d0.active_tokens = 10
    assert _placed_on(orchestrator, decode, turn + [9] * 30) == D0  # 70 + 10 to 70 + 20
    d0.active_tokens = d1.active_tokens = 0
    _assert_idle(orchestrator, decode)


def test_a_request_counts_its_prompt_and_output_as_active_until_it_ends():
    orchestrator, _, decode = _stack(decodes=(D0,))
    decode.stall = True

    async def run() -> None:
        task = asyncio.create_task(_generate(orchestrator))
        await decode.generating.wait()
        assert orchestrator.decodes[0].active_tokens == len(REQUEST.prompt_ids) + 8
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert orchestrator.decodes[0].active_tokens == 0
    _assert_idle(orchestrator, decode)


def test_without_prefix_caching_the_least_loaded_decode_takes_every_prompt():
    orchestrator, _, decode = _stack(decodes=(D0, D1))
    asyncio.run(orchestrator.probe())
    d0, d1 = orchestrator.decodes
    turn = list(range(100, 140))
    d0.outstanding_tokens = 100
    assert _placed_on(orchestrator, decode, turn) == D1
    d0.outstanding_tokens, d1.outstanding_tokens = 0, 300
    assert _placed_on(orchestrator, decode, turn + [5] * 20) == D0
    d1.outstanding_tokens = 0
    _assert_idle(orchestrator, decode)


@pytest.mark.parametrize("status", [500, 503])
def test_a_failed_prefill_is_retried_once_on_the_other(status):
    orchestrator, prefill, decode = _stack()
    prefill.script(P0, answer(status))
    items = asyncio.run(_generate(orchestrator))
    assert isinstance(items[-1], Finished)
    assert prefill.calls == [("complete", P0), ("complete", P1)]
    assert _health(orchestrator)[P0] == (status != 503)  # a 503: its engine failed
    assert not decode.aborts()
    _assert_idle(orchestrator, decode)


def test_a_prefill_marked_down_is_tried_last():
    orchestrator, prefill, decode = _stack()
    orchestrator.prefills[0].healthy = False
    asyncio.run(_generate(orchestrator))
    assert prefill.calls == [("complete", P1)]
    _assert_idle(orchestrator, decode)


@pytest.mark.parametrize(
    ("failures", "undelivered"),
    [
        ((refused(), refused()), True),
        ((refused(), dropped()), False),
        ((dropped(), answer(502)), False),
    ],
    ids=["never-connected", "one-connected", "both-reached"],
)
def test_prefill_failing_twice_aborts_the_reservation(failures, undelivered):
    orchestrator, prefill, decode = _stack(decode_only_fallback=False)
    prefill.script(P0, failures[0])
    prefill.script(P1, failures[1])
    (error,) = asyncio.run(_generate(orchestrator))
    assert isinstance(error, PrefillFailed) and error.status == 503
    assert P1 in str(error)  # the last failure is the one reported
    (abort,) = decode.aborts()
    assert abort.reason == "prefill failed" and abort.ticket_undelivered == undelivered
    assert not any(rpc == "Generate" for rpc, _, _ in decode.calls)
    _assert_idle(orchestrator, decode)


def test_connection_failures_mark_prefills_down_until_their_health_answers():
    orchestrator, prefill, decode = _stack()
    prefill.script(P0, refused())
    prefill.script(P1, dropped())
    asyncio.run(_generate(orchestrator))
    assert _health(orchestrator) == {P0: False, P1: False, D0: True}
    prefill.up[P0] = False
    asyncio.run(orchestrator.probe())
    assert _health(orchestrator) == {P0: False, P1: True, D0: True}
    assert ("health", P0) in prefill.calls
    _assert_idle(orchestrator, decode)


@pytest.mark.parametrize(
    ("reply", "status", "message"),
    [
        (answer(400, {"error": {"message": "prompt too long"}}), 400, "prompt too long"),
        (answer(422, {"object": "error", "message": "bad seed"}), 422, "bad seed"),
        (answer(200, {"choices": []}), 502, "without kv_transfer_params.first_token_id"),
        (
            answer(200, {"choices": [], "kv_transfer_params": {"first_token_id": 5}}),
            502,
            "without choices[0].token_ids",
        ),
    ],
    ids=["refused", "refused-flat-body", "no-connector", "no-first-token"],
)
def test_a_prefill_answer_at_fault_is_not_retried(reply, status, message):
    """A refusal is the client's: its status and the prefill's own message are passed on, and
    the instance stays up."""
    orchestrator, prefill, decode = _stack()
    prefill.script(P0, reply)
    (error,) = asyncio.run(_generate(orchestrator))
    assert isinstance(error, PrefillFailed) and error.status == status
    assert message in str(error) and (status == 502 or str(error) == message)
    assert prefill.calls == [("complete", P0)] and orchestrator.prefills[0].healthy
    assert decode.aborts()[0].ticket_undelivered is False
    _assert_idle(orchestrator, decode)


def test_logprobs_of_the_first_token_come_from_the_prefill_and_the_rest_from_the_decode():
    orchestrator, prefill, decode = _stack()
    sampling = decode_pb2.SamplingParams(temperature=0.5, logprobs=1)
    request = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=8, sampling=sampling)
    items = asyncio.run(_generate(orchestrator, request))
    assert prefill.prefilled[0].sampling.logprobs == 1
    generate = next(r for rpc, _, r in decode.calls if rpc == "Generate")
    first = logprob_of(prefill.first_token)
    del first.top_token_ids[1:], first.top_logprobs[1:]  # the one alternative asked for
    assert generate.first_token_logprobs == first
    assert items[0].logprobs == [first] and items[1].logprobs == [logprob_of(t) for t in ids("ar")]
    _assert_idle(orchestrator, decode)


@pytest.mark.parametrize("aggregated", [False, True], ids=["prefill", "local"])
def test_the_prompts_logprobs_come_first_for_every_choice(aggregated):
    """From the prefill's reply (vLLM's shape), or the decode's first message of choice 0."""
    orchestrator, prefill, decode = _stack(aggregated=aggregated)
    sampling = decode_pb2.SamplingParams(temperature=0.5, prompt_logprobs=1)
    request = GenerationRequest(prompt_ids=[70, 71, 72], max_tokens=8, sampling=sampling, n=2)
    items = asyncio.run(_generate(orchestrator, request))
    expected = [prompt_logprob_of(t, 1) for t in (71, 72)]
    assert items[:2] == [PromptLogprobs([70, 71, 72], expected, i) for i in range(2)]
    assert all(not isinstance(item, PromptLogprobs) for item in items[2:])
    assert [p.sampling.prompt_logprobs for p in prefill.prefilled] == [] if aggregated else [1]
    _assert_idle(orchestrator, decode)


def test_a_prefill_reply_without_the_prompts_logprobs_asked_for_is_a_502():
    orchestrator, prefill, decode = _stack()
    reply = {"kv_transfer_params": {"first_token_id": 5},
             "choices": [{"index": 0, "token_ids": [5], "prompt_logprobs": [None]}]}  # fmt: skip
    prefill.script(P0, answer(200, reply))
    request = GenerationRequest([1, 2], 4, decode_pb2.SamplingParams(prompt_logprobs=0))
    (error,) = asyncio.run(_generate(orchestrator, request))
    assert error.status == 502 and "1 entries for a prompt of 2 tokens" in str(error)
    _assert_idle(orchestrator, decode)


def test_a_prefill_reply_without_the_logprobs_asked_for_is_a_502():
    orchestrator, prefill, decode = _stack()
    prefill.script(P0, answer(200, {"kv_transfer_params": {"first_token_id": 5},
                                    "choices": [{"index": 0, "token_ids": [5]}]}))  # fmt: skip
    request = GenerationRequest([1], 4, decode_pb2.SamplingParams(logprobs=0))
    (error,) = asyncio.run(_generate(orchestrator, request))
    assert error.status == 502 and "no logprobs for its token" in str(error)
    _assert_idle(orchestrator, decode)


def test_the_context_is_the_smallest_a_decode_server_reports():
    orchestrator, _, decode = _stack(decodes=(D0, D1))
    assert orchestrator.max_model_len(8192) == 8192  # none has answered yet
    decode.max_model_len = 4096
    asyncio.run(orchestrator.probe())
    assert orchestrator.max_model_len(8192) == 4096


def test_a_consumer_closing_the_stream_aborts_on_the_decode_server():
    orchestrator, _, decode = _stack()

    async def first_then_close():
        stream = orchestrator.generate(REQUEST, "req")
        first = await anext(stream)
        await stream.aclose()  # as after a stop string
        return first

    assert asyncio.run(first_then_close()) == Tokens(ids("P"))
    (abort,) = decode.aborts()
    assert abort.reason == "client gone" and not abort.ticket_undelivered
    _assert_idle(orchestrator, decode)


def test_a_consumer_closing_the_stream_after_the_finish_aborts_nothing():
    orchestrator, _, decode = _stack()

    async def until_finished_then_close():
        stream = orchestrator.generate(REQUEST, "req")
        async for item in stream:
            if isinstance(item, Finished):
                await stream.aclose()  # as text_events does, without reading past the Finished
                return item

    assert asyncio.run(until_finished_then_close()) == Finished("length", 0, 5)
    assert not decode.aborts()
    _assert_idle(orchestrator, decode)


def test_a_cancelled_consumer_aborts_on_the_decode_server():
    orchestrator, _, decode = _stack()
    decode.stall = True

    cancel_once(decode.generating, _generate(orchestrator))
    (abort,) = decode.aborts()
    assert abort.reason == "client gone"
    _assert_idle(orchestrator, decode)


def test_a_consumer_cancelled_before_its_reserve_answered_frees_the_reservation_at_once():
    """The decode server reserved, the answer is on its way: no prefill has the ticket, so the
    Abort says so and the blocks are freed at once, not at the ticket's deadline."""
    orchestrator, _, decode = _stack()
    decode.reserve_gate = asyncio.Event()  # never set: the answer never comes

    cancel_once(decode.reserving, _generate(orchestrator))
    (abort,) = decode.aborts()
    assert abort.reason == "client gone" and abort.ticket_undelivered
    assert [rpc for rpc, _, _ in decode.calls] == ["Reserve", "Abort"]
    _assert_idle(orchestrator, decode)


def test_a_consumer_cancelled_during_the_prefill_aborts_its_reservation():
    """Its ticket may still be written by the prefill: the Abort says so (the decode server
    keeps the blocks quarantined until that prefill commits), rather than leaving the
    reservation to its deadline."""
    orchestrator, prefill, decode = _stack()
    prefill.stall = True

    cancel_once(prefill.prefilling, _generate(orchestrator))
    (abort,) = decode.aborts()
    assert abort.reason == "client gone" and not abort.ticket_undelivered
    assert not any(rpc == "Generate" for rpc, _, _ in decode.calls)
    _assert_idle(orchestrator, decode)


def test_an_abort_that_fails_is_not_the_error_reported():
    orchestrator, prefill, decode = _stack(prefills=(P0,))
    prefill.script(P0, answer(502))
    decode.fail("Abort", D0, rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"))
    (error,) = asyncio.run(_generate(orchestrator))
    assert isinstance(error, PrefillFailed) and "502" in str(error)
    decode.ended |= set(decode.reserved)  # the decode server is gone, and its reservations
    _assert_idle(orchestrator, decode)


def test_an_unavailable_decode_is_passed_over_until_stats_answers_not_draining():
    """A Reserve refused with UNAVAILABLE (a decode server down, or draining) goes to another
    decode server: the request is served there, and the first one is left out until a Stats
    probe answers and does not say it is draining."""
    orchestrator, _, decode = _stack(decodes=(D0, D1))
    decode.unavailable.add(D0)
    items = asyncio.run(_generate(orchestrator))  # D0 first: both have no outstanding tokens
    assert isinstance(items[-1], Finished)
    assert [address for rpc, address, _ in decode.calls if rpc == "Reserve"] == [D0, D1]
    assert _health(orchestrator)[D0] is False
    assert isinstance(asyncio.run(_generate(orchestrator))[-1], Finished)
    assert {address for rpc, address, _ in decode.calls if rpc == "Generate"} == {D1}
    asyncio.run(orchestrator.probe())
    assert _health(orchestrator)[D0] is False  # Stats still fails
    decode.unavailable.clear()
    decode.draining.add(D0)
    asyncio.run(orchestrator.probe())
    assert _health(orchestrator)[D0] is False  # it answers, draining
    decode.draining.clear()
    asyncio.run(orchestrator.probe())
    assert _health(orchestrator)[D0] is True
    assert all(d.outstanding_tokens == 0 for d in orchestrator.decodes)
    _assert_idle(orchestrator, decode)


def test_a_probe_takes_out_an_instance_that_begins_to_drain_before_any_request_finds_it():
    """Every instance is asked at each probe, the healthy ones too: a decode server whose Stats
    says it drains, and a prefill whose health check fails (it drains, or its engine failed),
    get no request from then on, not even one to be refused and retried."""
    orchestrator, prefill, decode = _stack(decodes=(D0, D1))
    decode.draining.add(D0)
    prefill.up[P0] = False
    asyncio.run(orchestrator.probe())
    assert _health(orchestrator) == {P0: False, P1: True, D0: False, D1: True}
    assert isinstance(asyncio.run(_generate(orchestrator))[-1], Finished)
    assert [address for rpc, address, _ in decode.calls if rpc == "Reserve"] == [D1]
    assert [url for call, url in prefill.calls if call == "complete"] == [P1]
    decode.draining.clear()
    prefill.up[P0] = True
    asyncio.run(orchestrator.probe())
    assert all(_health(orchestrator).values())
    _assert_idle(orchestrator, decode)


def test_a_reserve_refused_everywhere_is_a_503():
    orchestrator, prefill, decode = _stack(decodes=(D0, D1))
    decode.unavailable |= {D0, D1}
    (error,) = asyncio.run(_generate(orchestrator))
    assert error.status == 503 and "no decode instance" in str(error)
    assert not prefill.calls and all(d.outstanding_tokens == 0 for d in orchestrator.decodes)
    _assert_idle(orchestrator, decode)


def test_no_decode_available_is_a_503_after_asking_the_down_ones_again():
    orchestrator, prefill, decode = _stack()
    orchestrator.decodes[0].healthy = False
    decode.unavailable.add(D0)
    (error,) = asyncio.run(_generate(orchestrator))
    assert error.status == 503 and "no decode instance" in str(error)
    assert [rpc for rpc, _, _ in decode.calls] == ["Stats"] and not prefill.calls
    # Back (e.g. restarted on its address) before the next probe: the request finds it.
    decode.unavailable.clear()
    assert isinstance(asyncio.run(_generate(orchestrator))[-1], Finished)
    _assert_idle(orchestrator, decode)


def test_unavailable_mid_stream_ends_it_with_a_503_and_marks_the_decode_down():
    orchestrator, _, decode = _stack()
    decode.stream_error = rpc_error(grpc.StatusCode.UNAVAILABLE, "socket closed")
    items = asyncio.run(_generate(orchestrator))
    assert [item.ids for item in items[:3]] == decode.tokens
    assert items[3].status == 503 and "socket closed" in str(items[3])
    assert _health(orchestrator)[D0] is False
    _assert_idle(orchestrator, decode)


@pytest.mark.parametrize(
    ("code", "status", "message"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, 503, f"decode server {D0}: slow"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, f"decode server {D0} is full: slow"),
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "slow"),
        (grpc.StatusCode.INTERNAL, 502, f"decode server {D0}: slow"),
    ],
)
def test_a_reserve_failure_other_than_unavailable_is_an_http_status_and_not_down(
    code, status, message
):
    orchestrator, prefill, decode = _stack()
    decode.fail("Reserve", D0, rpc_error(code, "slow"))
    (error,) = asyncio.run(_generate(orchestrator))
    assert (error.status, str(error)) == (status, message)
    assert _health(orchestrator)[D0] is True
    assert not prefill.calls
    _assert_idle(orchestrator, decode)


def test_a_stream_ending_without_a_finish_is_a_502():
    orchestrator, _, decode = _stack()
    decode.finish = None
    items = asyncio.run(_generate(orchestrator))
    assert items[-1].status == 502 and "ended the stream early" in str(items[-1])
    _assert_idle(orchestrator, decode)


def _tokenize(orchestrator: Orchestrator) -> list[int] | BackendError:
    async def run():
        try:
            return await orchestrator.tokenize({"prompt": "hi"})
        except BackendError as e:
            return e

    return asyncio.run(run())


def test_tokenize_retries_a_server_error_on_the_other_prefill():
    orchestrator, prefill, decode = _stack()
    prefill.script(P0, answer(503))
    assert _tokenize(orchestrator) == prefill.tokens
    assert prefill.calls == [("tokenize", P0), ("tokenize", P1)]
    _assert_idle(orchestrator, decode)


def test_tokenize_does_not_retry_a_refused_request():
    orchestrator, prefill, _ = _stack()
    prefill.script(P0, answer(400, {"detail": "says no"}))
    result = _tokenize(orchestrator)
    assert isinstance(result, BackendError) and result.status == 400
    assert P0 in str(result) and "says no" in str(result)
    assert prefill.calls == [("tokenize", P0)]


@pytest.mark.parametrize("prefills", [(P0, P1), (P0,)], ids=["two", "one"])
def test_tokenize_with_every_prefill_failing_is_a_503_naming_the_last(prefills):
    orchestrator, prefill, decode = _stack(prefills=prefills)
    prefill.script(P0, answer(500))
    prefill.script(P1, dropped())
    result = _tokenize(orchestrator)
    assert isinstance(result, BackendError) and result.status == 503
    assert prefills[-1] in str(result)
    assert [url for _, url in prefill.calls] == list(prefills)
    _assert_idle(orchestrator, decode)


def test_n_choices_start_from_their_own_first_tokens_and_stop_one_by_one():
    orchestrator, prefill, decode = _stack()
    sampling = decode_pb2.SamplingParams(temperature=1.0, seed=5, logprobs=0)
    request = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=8, sampling=sampling, n=3)

    async def run():
        generation = orchestrator.generate(request, "req")
        items = []
        async for item in generation:
            items.append(item)
            if len(items) == 3:  # one message of each choice: choice 1 is done
                await generation.stop_choice(1)
        return items

    items = asyncio.run(run())
    assert prefill.prefilled[0].n == 3  # one prefill for every choice
    generate = next(r for rpc, _, r in decode.calls if rpc == "Generate")
    firsts = [generate.first_token_id] + [c.first_token_id for c in generate.other_choices]
    assert firsts == [prefill.first_token + i for i in range(3)]
    assert [c.first_token_logprobs.logprob for c in generate.other_choices] == [
        logprob_of(prefill.first_token + i).logprob for i in (1, 2)]  # fmt: skip
    assert [i.index for i in items if isinstance(i, Finished)] == [0, 1, 2]
    assert {i.index for i in items if isinstance(i, Tokens)} == {0, 1, 2}
    (abort,) = decode.aborts()
    assert list(abort.choices) == [1] and abort.reason == "choice done"
    assert orchestrator.decodes[0].outstanding_tokens == 0
    _assert_idle(orchestrator, decode)


def test_placed_blocks_forget_a_prompts_end_before_its_start():
    placed = PlacedBlocks()
    placed.capacity = 3
    placed.place([b"a", b"b", b"c"])
    placed.place([b"x", b"y"])  # two of the first prompt's names must go: its last two
    assert placed.matched([b"a", b"b", b"c"]) == 1
    assert placed.matched([b"x", b"y"]) == 2
