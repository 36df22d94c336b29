"""The connector's scheduler side alone, stepped the way vLLM's scheduler calls it: which
requests it claims, which prompt tokens each step's plan sends, and what a finished request
returns. Every test ends with nothing tracked (the leak check)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from prefill.ticket import DECODE_KEY, TICKET_KEY, transfer_params
from prefill.vllm_scheduler_side import SchedulerSide
from proto.tandem.v1 import decode_pb2

BLOCK = 128  # vLLM's CPU block size


@dataclass
class FakeRequest:
    """The fields of vLLM's Request the scheduler side reads."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)


def _params(num_tokens: int, request_id: str = "t1", num_senders: int = 1) -> dict:
    ticket = decode_pb2.Ticket(
        request_id=request_id, generation=3, num_tokens=num_tokens, num_senders=num_senders,
        block_ids=[0], shards=[decode_pb2.KvShard(rank=0)],
    )  # fmt: skip
    return transfer_params(ticket, "127.0.0.1:5")


def _side(blocks: dict[str, list[int]]) -> SchedulerSide:
    return SchedulerSide(num_senders=1, block_ids_of=lambda req_id: blocks[req_id])


def _step(side: SchedulerSide, request: FakeRequest, scheduled: int):
    """One engine step computing `scheduled` tokens of `request`: (plans, kv_transfer_params
    if it finished)."""
    side.track(request)
    meta = side.build_meta({request.request_id: scheduled})
    request.num_computed_tokens += scheduled
    if request.num_computed_tokens == request.num_prompt_tokens:
        request.output_token_ids.append(42)
        return meta.plans, side.finished(request)
    return meta.plans, None


def test_a_request_without_a_ticket_is_never_claimed():
    side = _side({})
    request = FakeRequest("plain", 10, kv_transfer_params={"do_remote_decode": True})
    plans, finished = _step(side, request, 10)
    assert plans == [] and finished == (False, None)
    assert side.num_tracked == 0


def test_chunked_prefill_sends_each_chunk_and_commits_with_the_last():
    side = _side({"r": [7, 3, 9]})
    request = FakeRequest("r", 300, _params(300))
    steps = [_step(side, request, n) for n in (64, 64, 64, 64, 44)]
    plans = [p for step_plans, _ in steps for p in step_plans]
    assert [(p.start, p.end, p.final) for p in plans] == [
        (0, 64, False), (64, 128, False), (128, 192, False), (192, 256, False), (256, 300, True),
    ]  # fmt: skip
    assert all(p.block_ids == (7, 3, 9) and not p.error for p in plans)
    # The ticket goes to the worker side once, with the first plan.
    ticket = decode_pb2.Ticket.FromString(plans[0].ticket)
    assert ticket.request_id == "t1" and plans[0].decode_address == "127.0.0.1:5"
    assert all(p.ticket == b"" and p.decode_address == "" for p in plans[1:])
    assert steps[-1][1] == (False, {"first_token_id": 42, "kv_tokens": 300})
    assert side.num_tracked == 0


def test_a_prefix_cache_hit_is_sent_with_the_first_step():
    side = _side({"r": [4, 5, 6]})
    request = FakeRequest("r", 300, _params(300), num_computed_tokens=2 * BLOCK)
    plans, finished = _step(side, request, 300 - 2 * BLOCK)
    assert [(p.start, p.end, p.final) for p in plans] == [(0, 300, True)]
    assert finished[1]["first_token_id"] == 42
    assert side.num_tracked == 0


def test_recomputing_after_a_preemption_sends_only_what_was_not_sent():
    side = _side({"r": [1, 2, 3]})
    request = FakeRequest("r", 300, _params(300))
    _step(side, request, 128)
    request.num_computed_tokens = 0  # preempted: its blocks were freed
    assert _step(side, request, 100)[0] == []
    plans, _ = _step(side, request, 100)
    assert [(p.start, p.end) for p in plans] == [(128, 200)]
    plans, finished = _step(side, request, 100)
    assert [(p.start, p.end, p.final) for p in plans] == [(200, 300, True)]
    assert finished[1] is not None and side.num_tracked == 0


def test_a_request_ending_before_its_prompt_gets_an_error_plan_in_the_next_step():
    side = _side({"r": [1, 2, 3]})
    request = FakeRequest("r", 300, _params(300))
    _step(side, request, 64)
    assert side.finished(request) == (False, None)  # aborted by the client
    assert side.has_pending_work()
    plans = side.build_meta({}).plans
    assert [(p.req_id, p.final, p.error) for p in plans] == [
        ("r", True, "the request ended before its prompt was prefilled")
    ]
    assert plans[0].ticket == b""  # the worker side has it already
    assert not side.has_pending_work() and side.num_tracked == 0


def test_a_request_aborted_before_its_first_step_still_hands_its_ticket_over():
    side = _side({})
    request = FakeRequest("r", 30, _params(30))
    side.track(request)
    side.finished(request)
    (plan,) = side.build_meta({}).plans
    assert plan.final and plan.error and decode_pb2.Ticket.FromString(plan.ticket).generation == 3
    assert side.num_tracked == 0


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (_params(31), "ticket t1 is for 31 prompt tokens, the request has 30"),
        (_params(30, num_senders=2), "expects 2 sender rank(s), vLLM runs 1"),
    ],
)
def test_a_ticket_that_does_not_fit_the_request_fails_by_name(params, want):
    side = _side({"r": [1]})
    request = FakeRequest("r", 30, params)
    plans, finished = _step(side, request, 30)
    assert len(plans) == 1 and want in plans[0].error and plans[0].final
    assert finished == (False, {"first_token_id": 42, "kv_tokens": 30})
    assert side.num_tracked == 0


def test_a_malformed_ticket_is_not_claimed():
    side = _side({})
    request = FakeRequest("r", 30, {TICKET_KEY: "not base64!", DECODE_KEY: "x"})
    plans, finished = _step(side, request, 30)
    assert plans == [] and finished == (False, None)
    assert side.num_tracked == 0
