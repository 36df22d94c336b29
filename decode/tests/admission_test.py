"""Request states, failure kinds, generations, deadlines and quarantine, on a fake clock; every
test ends with the pool back to all free and no request live."""

import threading

import grpc
import pytest

from decode.admission import QUARANTINE_GRACE_S, Admission, RequestState
from decode.failures import UNCLAIMED_S, AdmissionError, FailureKind
from engine.block_names import block_names
from engine.kv_cache import BlockPool
from engine.prefix_cache import PrefixCache

LAYERS, PER_TOKEN = 4, 100  # 4 layers, 100 KV bytes per token


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock():
    return Clock()


@pytest.fixture()
def admission(clock):
    adm = Admission(BlockPool(10), 16, LAYERS, PER_TOKEN, 1000, default_timeout_s=5, clock=clock)
    yield adm
    clock.now += 1000  # every deadline and quarantine behind us
    adm.expire()
    assert adm.pool.num_free == adm.pool.num_total
    assert adm.num_reserved == 0 and adm.num_quarantined_blocks == 0 and adm.num_live == 0


def _code(call) -> grpc.StatusCode:
    with pytest.raises(AdmissionError) as err:
        call()
    return err.value.code


def _failure(call) -> tuple[grpc.StatusCode, FailureKind | None, str]:
    with pytest.raises(AdmissionError) as err:
        call()
    return err.value.code, err.value.kind, str(err.value)


def test_reserve_commit_take_finish(admission):
    res = admission.reserve("a", list(range(40)), num_senders=2, max_tokens=8)
    assert (res.generation, res.block_ids, res.expected_bytes) == (1, [0, 1, 2], 4000)
    assert admission.commit("a", 1, rank=1, nbytes=1500, layers=LAYERS) == (1, 2)
    assert res.state is RequestState.RESERVED
    assert admission.commit("a", 1, rank=0, nbytes=2500, layers=LAYERS) == (2, 2)
    assert admission.wait_ready("a", 1) is res
    assert admission.take(res) == [0, 1, 2]
    assert res.state is RequestState.RUNNING and admission.num_live == 1
    assert admission.commit("a", 1, rank=0, nbytes=2500, layers=LAYERS) == (2, 2)  # a retry
    assert _code(lambda: admission.wait_ready("a", 1)) == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(lambda: admission.reserve("a", [1], 1, 1)) == grpc.StatusCode.ALREADY_EXISTS
    admission.pool.free(res.block_ids)  # as the engine does when the sequence ends
    admission.finish(res)
    assert res.state is RequestState.FINISHED
    assert _code(lambda: admission.wait_ready("a", 1)) == grpc.StatusCode.NOT_FOUND


def test_abort_reports_the_state_it_found(admission):
    """RESERVED and READY tickets fail; a RUNNING one is the engine's to stop; anything else
    (finished, failed, another generation, unknown) matches nothing."""
    reserved = admission.reserve("r", [1] * 20, num_senders=1, max_tokens=1)
    admission.reserve("ready", [1] * 20, num_senders=1, max_tokens=1)
    admission.commit("ready", 1, 0, 2000, LAYERS)
    running = admission.reserve("run", [1] * 20, num_senders=1, max_tokens=1)
    admission.commit("run", 1, 0, 2000, LAYERS)
    admission.take(running)
    assert admission.abort("r", generation=2) is None  # not its generation
    assert admission.abort("r") is RequestState.RESERVED
    assert admission.abort("ready", generation=1) is RequestState.READY
    assert admission.abort("run") is RequestState.RUNNING
    assert running.state is RequestState.RUNNING  # unchanged: the engine loop stops it
    assert admission.abort("r") is None and reserved.state is RequestState.FAILED
    assert admission.abort("nobody") is None
    admission.pool.free(running.block_ids)
    admission.finish(running)
    assert admission.abort("run") is None


def test_wait_ready_wakes_when_the_last_sender_commits(admission):
    admission.reserve("a", [1] * 10, num_senders=1, max_tokens=1)
    ready = []
    waiter = threading.Thread(target=lambda: ready.append(admission.wait_ready("a", 1)))
    waiter.start()
    admission.commit("a", 1, 0, 1000, LAYERS)
    waiter.join(timeout=5)
    assert ready and ready[0].state is RequestState.READY
    admission.pool.free(admission.take(ready[0]))
    admission.finish(ready[0])


def test_a_ticket_reserved_without_a_sender_count_takes_the_commits(admission, clock):
    # A tensor-parallel prefill's senders each name their count (vLLM's TP size).
    res = admission.reserve("a", list(range(40)), num_senders=0, max_tokens=8)
    assert admission.commit("a", 1, 1, 1500, LAYERS, num_senders=2) == (1, 2)
    assert res.state is RequestState.RESERVED
    assert admission.commit("a", 1, 0, 2500, LAYERS, num_senders=2) == (2, 2)
    admission.pool.free(admission.take(admission.wait_ready("a", 1)))
    admission.finish(res)
    # One of two never commits: the deadline names who did.
    res = admission.reserve("b", [1] * 20, num_senders=0, max_tokens=1)
    admission.commit("b", 1, 0, 1000, LAYERS, num_senders=2)
    clock.now = res.deadline
    assert _failure(lambda: admission.wait_ready("b", 1))[2] == (
        "not every sender committed by the deadline: 1 of 2 (committed ranks: [0])"
    )


def test_a_commit_naming_another_sender_count_fails_the_ticket(admission):
    admission.reserve("a", [1] * 20, num_senders=2, max_tokens=1)
    problem = "sender 0 reports 1 sender rank(s), the ticket expects 2"
    assert _failure(lambda: admission.commit("a", 1, 0, 2000, LAYERS, num_senders=1)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        FailureKind.BAD_COMMIT,
        problem,
    )
    assert _failure(lambda: admission.wait_ready("a", 1))[2] == problem
    assert admission.num_quarantined_blocks == 2  # neither sender has said it stopped writing


def test_missing_commit_fails_at_the_deadline_and_quarantines_until_grace(admission, clock):
    res = admission.reserve("a", [1] * 20, num_senders=2, max_tokens=1)
    admission.commit("a", 1, 0, 1000, LAYERS)
    clock.now = res.deadline
    assert _failure(lambda: admission.wait_ready("a", 1)) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        FailureKind.DEADLINE_MISSED,
        "not every sender committed by the deadline: 1 of 2 (committed ranks: [0])",
    )
    # Sender 1 may still be writing: its blocks stay out of the pool until the grace is over.
    assert admission.num_quarantined_blocks == 2 and admission.pool.num_free == 8
    clock.now = res.deadline + QUARANTINE_GRACE_S
    admission.expire()
    assert admission.pool.num_free == 10


def test_late_commit_of_a_failed_ticket_releases_its_quarantine_at_once(admission):
    admission.reserve("a", [1] * 20, num_senders=1, max_tokens=1)
    assert admission.abort("a", reason="client gone")
    assert admission.num_quarantined_blocks == 2
    assert _failure(lambda: admission.commit("a", 1, 0, 2000, LAYERS)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        FailureKind.ABORTED,
        "request 'a': client gone",
    )
    assert admission.num_quarantined_blocks == 0 and admission.pool.num_free == 10


def test_abort_of_an_undelivered_ticket_frees_at_once(admission):
    admission.reserve("a", [1] * 20, num_senders=1, max_tokens=1)
    assert admission.abort("a", reason="no prefill reachable", writers_possible=False)
    assert admission.num_quarantined_blocks == 0 and admission.pool.num_free == 10


def test_a_ready_ticket_nobody_generates_is_freed_after_a_while(admission, clock):
    """Its router prefilled it, then went away: the blocks must not be held for good."""
    admission.reserve("u", list(range(40)), num_senders=1, max_tokens=8)
    clock.now += 4  # committed just before the ticket's deadline (5 s)
    admission.commit("u", 1, rank=0, nbytes=4000, layers=LAYERS)
    clock.now += UNCLAIMED_S - 0.1
    admission.expire()
    assert admission.pool.num_free == 7  # still waiting for its Generate
    clock.now += 0.1
    admission.expire()
    assert admission.pool.num_free == admission.pool.num_total  # no writer left: freed at once
    code, kind, message = _failure(lambda: admission.wait_ready("u", 1))
    assert (code, kind) == (grpc.StatusCode.DEADLINE_EXCEEDED, FailureKind.UNCLAIMED)
    assert "no Generate came within 30 s" in message


def test_abort_of_a_ready_ticket_frees_at_once(admission):
    admission.reserve("a", [1] * 20, num_senders=1, max_tokens=1)
    admission.commit("a", 1, 0, 2000, LAYERS)
    assert admission.abort("a")
    assert admission.pool.num_free == 10
    # A late Generate learns why.
    assert _failure(lambda: admission.wait_ready("a", 1)) == (
        grpc.StatusCode.ABORTED,
        FailureKind.ABORTED,
        "aborted",
    )


def test_stale_generation_is_refused_and_changes_nothing(admission):
    admission.reserve("a", [1] * 20, num_senders=1, max_tokens=1)
    admission.abort("a")
    res = admission.reserve("a", [1] * 20, num_senders=1, max_tokens=1)
    assert res.generation == 2
    code = _code(lambda: admission.commit("a", 1, 0, 2000, LAYERS))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # generation 1's quarantine: released
    assert res.state is RequestState.RESERVED and res.committed == {}
    stale = _code(lambda: admission.commit("a", 7, 0, 2000, LAYERS))
    assert stale == grpc.StatusCode.FAILED_PRECONDITION
    admission.abort("a")


def test_wrong_byte_count_or_layers_fail_the_ticket(admission):
    admission.reserve("a", [1] * 20, num_senders=1, max_tokens=1)
    short = "senders wrote 1999 bytes of KV, the prompt's 20 uncached tokens need 2000"
    assert _failure(lambda: admission.commit("a", 1, 0, 1999, LAYERS)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        FailureKind.BAD_COMMIT,
        short,
    )
    assert admission.pool.num_free == 10  # its only sender committed: nothing can still write
    assert _failure(lambda: admission.wait_ready("a", 1)) == (
        grpc.StatusCode.ABORTED,
        FailureKind.BAD_COMMIT,
        short,
    )
    admission.reserve("b", [1] * 20, num_senders=1, max_tokens=1)
    code = _code(lambda: admission.commit("b", 1, 0, 2000, LAYERS - 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert _failure(lambda: admission.wait_ready("b", 1))[:2] == (
        grpc.StatusCode.ABORTED,
        FailureKind.BAD_COMMIT,
    )
    assert _code(lambda: admission.wait_ready("b", 2)) == grpc.StatusCode.NOT_FOUND


def test_sender_error_fails_the_ticket_with_its_reason(admission):
    admission.reserve("a", [1] * 20, num_senders=2, max_tokens=1)
    admission.commit("a", 1, 1, 0, 0, error="CUDA out of memory")
    assert admission.num_quarantined_blocks == 2  # rank 0 has not committed: may be writing
    assert _failure(lambda: admission.wait_ready("a", 1)) == (
        grpc.StatusCode.ABORTED,
        FailureKind.SENDER_FAILED,
        "sender 1 failed: CUDA out of memory",
    )


def test_capacity_and_argument_checks(admission):
    code = grpc.StatusCode
    assert _code(lambda: admission.reserve("a", [1] * 200, 1, 1)) == code.RESOURCE_EXHAUSTED
    assert _code(lambda: admission.reserve("a", [1] * 990, 1, 20)) == code.INVALID_ARGUMENT
    assert _code(lambda: admission.reserve("a", [], 1, 1)) == code.INVALID_ARGUMENT
    assert _code(lambda: admission.reserve("", [1], 1, 1)) == code.INVALID_ARGUMENT
    admission.reserve("a", [1], 1, 1)
    assert _code(lambda: admission.reserve("a", [1], 1, 1)) == code.ALREADY_EXISTS
    assert _code(lambda: admission.commit("a", 1, 5, 100, LAYERS)) == code.INVALID_ARGUMENT
    assert _code(lambda: admission.commit("zz", 1, 0, 100, LAYERS)) == code.NOT_FOUND
    admission.abort("a")


def test_reserve_takes_the_cached_blocks_a_prompt_starts_with(clock):
    pool = BlockPool(10)
    cache = PrefixCache(pool, 16)
    adm = Admission(pool, 16, LAYERS, PER_TOKEN, 1000, default_timeout_s=5, clock=clock,
                    prefix_cache=cache)  # fmt: skip
    # Blocks 0-2 held [0, 48) of an earlier prompt, named as its forward wrote them.
    earlier = pool.allocate(3)
    for block_id, name in zip(earlier, block_names(list(range(48)), 16, 3, []), strict=True):
        pool.name(block_id, name)
    pool.free(earlier)
    # 40 shared tokens: two whole blocks found, the third (different from token 40 on) not.
    res = adm.reserve("a", list(range(40)) + [99] * 10, num_senders=1, max_tokens=8)
    assert (res.block_ids[:2], res.num_cached_tokens, res.expected_bytes) == ([0, 1], 32, 1800)
    assert len(res.block_ids) == 4 and pool.refcount(0) == pool.refcount(1) == 1
    # The same prompt again while "a" holds them: shared, not copied.
    again = adm.reserve("b", list(range(40)) + [99] * 10, num_senders=1, max_tokens=8)
    assert again.block_ids[:2] == [0, 1] and pool.refcount(0) == 2
    # A prompt ending on a block's last token still sends that block: its last token's KV.
    whole = adm.reserve("c", list(range(48)), num_senders=1, max_tokens=8)
    assert whole.num_cached_tokens == 32 and whole.block_ids[:2] == [0, 1]
    assert (cache.queried_tokens, cache.hit_tokens) == (148, 96)
    # No room for the rest: refused, and the cached blocks it took are given back.
    assert _code(lambda: adm.reserve("d", list(range(48)) + [5] * 40, 1, 8)) is (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert pool.refcount(0) == 3
    for request_id in "abc":
        adm.abort(request_id, writers_possible=False)
    assert pool.num_free == pool.num_total
