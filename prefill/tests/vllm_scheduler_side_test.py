"""The connector's scheduler side alone, stepped the way vLLM's scheduler calls it: which
requests it claims, which prompt tokens each step's plan sends, what a finished request
returns, and that vLLM's n > 1 children, sharing one ticket, send it once. Every test ends with
nothing tracked (the leak check)."""

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


def _params(
    num_tokens: int, request_id: str = "t1", num_senders: int = 1, generation: int = 3
) -> dict:
    ticket = decode_pb2.Ticket(
        request_id=request_id, generation=generation, num_tokens=num_tokens,
        num_senders=num_senders, block_ids=[0], shards=[decode_pb2.KvShard(rank=0)],
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


def _children(n: int, params: dict, num_tokens: int = 200) -> list[FakeRequest]:
    """vLLM's n > 1: child i is "{i}_{parent id}", every one with the parent's ticket."""
    return [FakeRequest(f"{i}_cmpl-p", num_tokens, params) for i in range(n)]


def test_children_sharing_a_ticket_send_it_once_and_each_return_its_first_token():
    children = _children(3, _params(200))
    side = _side({child.request_id: [5, 6] for child in children})
    for child in children:
        side.track(child)
    plans = side.build_meta({child.request_id: 200 for child in children}).plans
    assert [(p.req_id, p.start, p.end, p.final) for p in plans] == [("0_cmpl-p", 0, 200, True)]
    for child, token in zip(children[:2], (42, 43), strict=True):
        child.num_computed_tokens = 200
        child.output_token_ids.append(token)
    # The third is aborted before its first token: a rider fails nothing.
    assert [side.finished(child) for child in children] == [
        (False, {"first_token_id": 42, "kv_tokens": 200}),
        (False, {"first_token_id": 43, "kv_tokens": 200}),
        (False, None),
    ]
    assert not side.has_pending_work() and side.build_meta({}).plans == []
    assert side.num_tracked == 0


def test_a_child_first_scheduled_after_its_sender_finished_does_not_send():
    first, late = _children(2, _params(200))
    side = _side({first.request_id: [1, 2], late.request_id: [3, 4]})
    plans, finished = _step(side, first, 200)
    assert len(plans) == 1 and finished[1]["first_token_id"] == 42
    plans, finished = _step(side, late, 200)
    assert plans == [] and finished == (False, {"first_token_id": 42, "kv_tokens": 200})
    assert side.num_tracked == 0


def test_requests_with_different_tickets_each_send():
    requests = [
        FakeRequest("a", 30, _params(30, request_id="t1")),
        FakeRequest("b", 30, _params(30, request_id="t1", generation=4)),  # a later reservation
        FakeRequest("c", 30, _params(30, request_id="t2")),
    ]
    side = _side({r.request_id: [1] for r in requests})
    for request in requests:
        side.track(request)
    plans = side.build_meta({r.request_id: 30 for r in requests}).plans
    assert [(p.req_id, p.final, p.error) for p in plans] == [(r, True, "") for r in "abc"]
    for request in requests:
        assert side.finished(request) == (False, None)  # ended before its first token
    assert side.num_tracked == 0
