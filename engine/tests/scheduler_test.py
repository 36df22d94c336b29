"""Scheduler and Sequence behaviour with exact block ids; every test ends with a leak check."""

import pytest

from engine.kv_cache import BlockPool
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus, StopConditions
from engine.step_plan import StepPlan

EOS = 2


def _seq(seq_id: str, prompt_len: int, max_tokens: int = 8, **stop) -> Sequence:
    return Sequence(
        seq_id,
        list(range(10, 10 + prompt_len)),
        SamplingParams(),
        StopConditions(max_tokens=max_tokens, **stop),
        eos_token_ids=[EOS],
        max_model_len=64,
    )


def _scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size, max_num_seqs, budget), BlockPool(num_blocks))


def _shape(plan: StepPlan) -> list[tuple[str, int, bool]]:
    return [(s.seq.seq_id, s.num_new_tokens, s.samples) for s in plan.scheduled]


def _run_to_end(sched: Scheduler, token: int = 7) -> None:
    for _ in range(1000):
        plan = sched.schedule()
        if plan is None:
            return
        sched.update(plan, {s.seq.seq_id: token for s in plan.scheduled if s.samples})
    raise AssertionError("did not finish")


def _assert_empty(sched: Scheduler) -> None:
    assert sched.num_unfinished == 0
    assert sched.pool.num_free == sched.pool.num_total


def test_prefill_then_decode_with_exact_blocks():
    sched = _scheduler()
    a, b = _seq("a", 5), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert _shape(plan) == [("a", 5, True), ("b", 3, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2])
    sched.update(plan, {"a": 100, "b": 101})
    assert (a.num_computed, a.output_ids, b.output_ids) == (5, [100], [101])
    plan = sched.schedule()
    assert _shape(plan) == [("a", 1, True), ("b", 1, True)]
    assert plan.is_decode_only
    assert b.block_ids == [2]  # b's 4th token still fits its first block
    sched.update(plan, {"a": 102, "b": 103})
    sched.schedule()
    assert b.block_ids == [2, 3]  # b's 5th token opens a block
    for seq in (a, b):
        sched.abort([seq.seq_id])
    _assert_empty(sched)


def test_long_prompt_is_prefilled_in_chunks_and_samples_once():
    sched = _scheduler(budget=8)
    seq = _seq("long", 19, max_tokens=2)
    sched.add(seq)
    shapes = []
    while (plan := sched.schedule()) is not None:
        shapes.append(_shape(plan))
        sched.update(plan, {s.seq.seq_id: 50 for s in plan.scheduled if s.samples})
    assert shapes == [
        [("long", 8, False)],
        [("long", 8, False)],
        [("long", 3, True)],
        [("long", 1, True)],
    ]
    assert seq.output_ids == [50, 50] and seq.finish_reason is FinishReason.LENGTH
    _assert_empty(sched)


def test_decodes_go_first_and_prefill_chunks_take_the_rest_of_the_budget():
    sched = _scheduler(budget=8)
    sched.add(_seq("a", 3))
    plan = sched.schedule()
    sched.update(plan, {"a": 1})
    sched.add(_seq("b", 12))
    assert _shape(sched.schedule()) == [("a", 1, True), ("b", 7, False)]
    for seq_id in ("a", "b"):
        sched.abort([seq_id])
    _assert_empty(sched)


def test_newest_running_sequence_is_preempted_and_recomputed():
    sched = _scheduler(num_blocks=3, block_size=4, budget=16)
    a, b = _seq("a", 4, max_tokens=6), _seq("b", 4, max_tokens=6)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()  # a: block 0, b: block 1
    sched.update(plan, {"a": 7, "b": 7})
    plan = sched.schedule()  # both need a 2nd block: a gets 2, none left for b
    assert [s.seq.seq_id for s in plan.scheduled] == ["a"]
    assert plan.preempted == (b,)
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed == 0
    assert list(sched.waiting) == [b]
    sched.update(plan, {"a": 7})
    _run_to_end(sched)
    # b was recomputed from prompt + its first token, then finished normally.
    assert b.output_ids == [7] * 6 and b.finish_reason is FinishReason.LENGTH
    _assert_empty(sched)


def test_a_sequence_that_can_never_fit_preempts_itself_and_waits():
    sched = _scheduler(num_blocks=2, block_size=4, budget=16)
    seq = _seq("a", 8, max_tokens=4)
    sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, {"a": 7})
    plan = sched.schedule()  # the 9th token needs a 3rd block: it preempts itself
    assert plan is None and seq.status is SequenceStatus.WAITING
    assert sched.pool.num_free == 2
    sched.abort(["a"])
    _assert_empty(sched)


def test_waiting_sequences_wait_for_blocks_in_order():
    sched = _scheduler(num_blocks=2, block_size=4)
    sched.add(_seq("a", 8, max_tokens=1))
    sched.add(_seq("b", 2, max_tokens=1))
    assert _shape(sched.schedule()) == [("a", 8, True)]  # b does not overtake a
    _run_to_end(sched)
    _assert_empty(sched)


def test_max_num_seqs_caps_the_batch():
    sched = _scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add(_seq(name, 2))
    assert [s.seq.seq_id for s in sched.schedule().scheduled] == ["a", "b"]
    for name in "abc":
        sched.abort([name])
    _assert_empty(sched)


def test_prefilled_sequence_starts_decoding_at_prompt_len():
    sched = _scheduler()
    ids = sched.pool.allocate(2)
    seq = _seq("p", 6)
    assert sched.add_prefilled(seq, ids, first_token=40)
    plan = sched.schedule()
    assert _shape(plan) == [("p", 1, True)]
    assert plan.scheduled[0].start == 6 and seq.token_ids[6] == 40 and seq.block_ids == ids
    assert seq.num_computed == 7  # counted when planned: the forward writes its KV
    sched.update(plan, {"p": 41})
    assert seq.output_ids == [40, 41]
    sched.abort(["p"])
    _assert_empty(sched)


def test_prefilled_sequence_finished_by_its_first_token_frees_its_blocks():
    sched = _scheduler()
    seq = _seq("p", 6)
    assert not sched.add_prefilled(seq, sched.pool.allocate(2), first_token=EOS)
    assert seq.finish_reason is FinishReason.STOP
    _assert_empty(sched)


def test_prefilled_sequence_without_blocks_recomputes_prompt_and_first_token():
    sched = _scheduler()
    seq = _seq("p", 6)
    assert sched.add_prefilled(seq, [], first_token=40)
    plan = sched.schedule()
    assert _shape(plan) == [("p", 7, True)] and plan.scheduled[0].start == 0
    assert seq.block_ids == [0, 1]
    sched.update(plan, {"p": 41})
    assert seq.output_ids == [40, 41]
    sched.abort(["p"])
    _assert_empty(sched)


def test_preempting_and_finishing_drop_one_reference_to_shared_blocks():
    sched = _scheduler(num_blocks=3, block_size=4, budget=16)
    shared = sched.pool.allocate(1)  # a prompt of 4 tokens, whose 2 choices share its block
    sched.pool.incref(shared)
    a, b = _seq("a", 4, max_tokens=6), _seq("b", 4, max_tokens=6)
    assert sched.add_prefilled(a, shared, first_token=7)
    assert sched.add_prefilled(b, shared, first_token=8)
    plan = sched.schedule()  # position 4 opens a block of its own for each
    assert (a.block_ids, b.block_ids) == ([0, 1], [0, 2])
    while not plan.preempted:  # until a's position 8 needs a third block
        sched.update(plan, {s.seq.seq_id: 7 for s in plan.scheduled})
        plan = sched.schedule()
    assert plan.preempted == (b,) and b.block_ids == [] and a.block_ids == [0, 1, 2]
    assert sched.pool.refcount(0) == 1  # a's alone
    sched.update(plan, {"a": 7})
    _run_to_end(sched)
    assert b.output_ids == [8] + [7] * 5 and b.finish_reason is FinishReason.LENGTH
    _assert_empty(sched)


@pytest.mark.parametrize(
    ("stop", "tokens", "expected_len", "reason"),
    [
        ({}, [5, EOS, 5], 2, FinishReason.STOP),
        ({"ignore_eos": True}, [5, EOS, 5, 5], 4, FinishReason.LENGTH),
        ({"stop_token_ids": (9,)}, [5, 9], 2, FinishReason.STOP),
        ({"min_tokens": 3}, [EOS, EOS, EOS], 3, FinishReason.STOP),
    ],
)
def test_stop_conditions(stop, tokens, expected_len, reason):
    seq = _seq("s", 3, max_tokens=4, **stop)
    reasons = [seq.append(t) for t in tokens]
    first_stop = next(i for i, r in enumerate(reasons) if r is not None)
    assert first_stop + 1 == expected_len and reasons[first_stop] is reason


@pytest.mark.parametrize(
    ("stop", "prompt_len", "token"),
    [
        ({}, 3, EOS),
        ({}, 3, 5),
        ({"ignore_eos": True}, 3, EOS),
        ({"stop_token_ids": (9,)}, 3, 9),
        ({"min_tokens": 1}, 3, EOS),
        ({"min_tokens": 2}, 3, EOS),
        ({"max_tokens": 1}, 3, 5),
        ({}, 63, 5),  # the context's last position
        ({}, 62, 5),
    ],
)
def test_first_token_finishes_as_append_tells(stop, prompt_len, token):
    """What a decode server tells before admitting a prefilled sequence (to stream its first
    token at once) must be what appending that token then decides."""
    told = _seq("f", prompt_len, **stop).first_token_finishes(token)
    seq = _seq("f", prompt_len, **stop)
    assert told is (seq.append(token) is not None)


def test_context_length_stops_generation():
    seq = Sequence("c", [1] * 62, SamplingParams(), StopConditions(max_tokens=10), [EOS], 64)
    assert seq.append(5) is None
    assert seq.append(5) is FinishReason.LENGTH


def test_invalid_requests_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        StopConditions(max_tokens=0)
    with pytest.raises(ValueError, match=r"^min_tokens: "):
        StopConditions(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match=r"^prompt: "):
        Sequence("x", [], SamplingParams(), StopConditions(max_tokens=1), [EOS], 64)
    with pytest.raises(ValueError, match=r"^prompt: 64 tokens"):
        Sequence("x", [1] * 64, SamplingParams(), StopConditions(max_tokens=1), [EOS], 64)
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens: "):
        SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=4)


def _decoding(sched: Scheduler, *seqs: Sequence) -> StepPlan:
    """Prefills seqs (one step, token 7 each); returns the first decode plan."""
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, {s.seq.seq_id: 7 for s in plan.scheduled})
    return sched.schedule()


def test_step_ahead_feeds_the_pending_tokens_and_grows_blocks_first():
    sched = _scheduler()
    a, b = _seq("a", 2), _seq("b", 3)
    plan = _decoding(sched, a, b)  # a: position 2 of 2 in block 0; b: position 3 in block 1
    assert [i.start for i in plan.scheduled] == [2, 3]
    ahead = sched.schedule_ahead(plan)
    # Each feeds the token `plan` samples, one position on; b's reaches a second block.
    assert _shape(ahead) == [("a", 1, True), ("b", 1, True)]
    assert [i.start for i in ahead.scheduled] == [3, 4]
    assert (a.block_ids, b.block_ids) == ([0], [1, 2])
    sched.update(plan, {"a": 20, "b": 21})
    sched.update(ahead, {"a": 22, "b": 23})
    assert (a.output_ids, b.output_ids) == ([7, 20, 22], [7, 21, 23])
    assert [i.start for i in sched.schedule().scheduled] == [4, 5]
    for name in "ab":
        sched.abort([name])
    _assert_empty(sched)


def test_sequence_stopping_under_a_step_ahead_keeps_its_blocks_until_that_step_is_updated():
    sched = _scheduler()
    a, b = _seq("a", 2), _seq("b", 2)
    plan = _decoding(sched, a, b)
    ahead = sched.schedule_ahead(plan)
    free = sched.pool.num_free
    assert sched.update(plan, {"a": EOS, "b": 30}) == [a]
    assert a.finish_reason is FinishReason.STOP and a.block_ids == []
    assert sched.pool.num_free == free  # the step ahead still writes a's KV
    after = sched.schedule_ahead(ahead)  # the batch goes on ahead without a
    assert _shape(after) == [("b", 1, True)]
    assert sched.pool.num_free == free - 1  # b's position 4 opens its second block
    assert not sched.ahead_is_idle
    assert sched.update(ahead, {"a": 31, "b": 32}) == []  # a's token there is thrown away
    assert a.output_ids == [7, EOS] and b.output_ids == [7, 30, 32]
    assert sched.pool.num_free == free  # a's block back: no step left writes it
    sched.update(after, {"b": 33})
    assert b.output_ids == [7, 30, 32, 33]
    sched.abort(["b"])
    _assert_empty(sched)


def test_sequence_aborted_under_two_steps_ahead_keeps_its_blocks_until_the_last_is_updated():
    sched = _scheduler()
    a, b = _seq("a", 2), _seq("b", 2)
    plan = _decoding(sched, a, b)
    first = sched.schedule_ahead(plan)
    sched.update(plan, {"a": 20, "b": 21})
    second = sched.schedule_ahead(first)  # both steps ahead write a's KV
    assert _shape(second) == [("a", 1, True), ("b", 1, True)]
    free = sched.pool.num_free
    sched.abort(["a"])
    sched.update(first, {"a": 22, "b": 23})
    assert sched.pool.num_free == free  # `second` still writes a's KV
    third = sched.schedule_ahead(second)
    assert _shape(third) == [("b", 1, True)]
    sched.update(second, {"a": 24, "b": 25})
    assert sched.pool.num_free == free + 2  # a's two blocks
    assert a.output_ids == [7, 20] and b.output_ids == [7, 21, 23, 25]
    sched.abort(["b"])
    assert sched.ahead_is_idle  # `third` has no live sequence left: the engine waits for it
    sched.update(third, {})
    _assert_empty(sched)


def test_aborting_every_sequence_of_a_step_ahead_leaves_it_idle():
    sched = _scheduler()
    a = _seq("a", 2)
    plan = _decoding(sched, a)
    ahead = sched.schedule_ahead(plan)
    sched.update(plan, {"a": 30})
    sched.abort(["a"])
    assert sched.ahead_is_idle and sched.pool.num_free < sched.pool.num_total
    sched.update(ahead, {})
    assert not sched.ahead_is_idle
    _assert_empty(sched)


def test_step_ahead_leaves_out_sequences_that_stop_on_their_length():
    """A sequence whose pending token is its last (max_tokens, or the context's end) would only
    waste the step ahead: the others go on without it, and it frees its blocks as it finishes."""
    sched = _scheduler()
    a, b, c = _seq("a", 2, max_tokens=2), _seq("b", 3), _seq("c", 2, max_tokens=2)
    plan = _decoding(sched, a, b, c)
    free = sched.pool.num_free
    ahead = sched.schedule_ahead(plan)
    assert _shape(ahead) == [("b", 1, True)]
    assert [i.start for i in ahead.scheduled] == [4]
    assert sched.pool.num_free == free - 1  # b's position 4 opens its second block
    assert sched.update(plan, {"a": 20, "b": 21, "c": 22}) == [a, c]
    assert (a.finish_reason, c.finish_reason) == (FinishReason.LENGTH, FinishReason.LENGTH)
    assert sched.pool.num_free == free - 1 + 2  # a's and c's blocks: no step ahead writes them
    assert sched.running == [b]
    after = sched.schedule_ahead(ahead)  # b alone goes on ahead
    assert _shape(after) == [("b", 1, True)] and after.scheduled[0].start == 5
    sched.update(ahead, {"b": 23})
    sched.update(after, {"b": 24})
    assert (a.output_ids, b.output_ids, c.output_ids) == ([7, 20], [7, 21, 23, 24], [7, 22])
    sched.abort(["b"])
    _assert_empty(sched)


def test_no_step_ahead_when_the_pending_tokens_decide_it():
    # Every sequence stopping on its length: the step ahead would have nothing to do.
    sched = _scheduler()
    plan = _decoding(sched, _seq("a", 2, max_tokens=2), _seq("b", 2, max_tokens=2))
    assert sched.schedule_ahead(plan) is None
    _run_to_end(sched)
    # Nor with penalties: they count every generated token, the pending one included.
    sched = _scheduler()
    seq = _seq("a", 2)
    seq.sampling = SamplingParams(temperature=1.0, presence_penalty=0.5)
    plan = _decoding(sched, seq)
    assert sched.schedule_ahead(plan) is None
    _run_to_end(sched)
    # Nor with a sequence waiting to be admitted: the next step prefills it.
    sched = _scheduler()
    plan = _decoding(sched, _seq("a", 2))
    sched.add(_seq("b", 2))
    assert sched.schedule_ahead(plan) is None
    _run_to_end(sched)
    # Nor after a prefill step: its sequences may not all sample.
    sched = _scheduler()
    sched.add(_seq("a", 2))
    plan = sched.schedule()
    assert sched.schedule_ahead(plan) is None
    sched.update(plan, {"a": 7})
    _run_to_end(sched)
    _assert_empty(sched)


def test_no_step_ahead_when_it_needs_a_block_and_none_is_free():
    sched = _scheduler(num_blocks=3, block_size=4)
    a, b = _seq("a", 3), _seq("b", 4)  # a's position after the next (4) needs a fourth block
    plan = _decoding(sched, a, b)
    assert sched.pool.num_free == 0
    assert sched.schedule_ahead(plan) is None
    assert [s.num_computed for s in (a, b)] == [4, 5]  # unchanged: nothing planned
    sched.update(plan, {"a": 7, "b": 7})
    _run_to_end(sched)
    _assert_empty(sched)


@pytest.mark.parametrize(("max_model_len", "room", "blocks"), [(64, 3, 3), (8, 2, 2)])
def test_a_drafting_step_holds_blocks_for_the_drafts_made_ahead(max_model_len, room, blocks):
    """With draft_lookahead, a step with draft room also holds the positions a proposer may
    draft into before the host reads the step (up to 2 past its drafts), never past the
    sequence's length limit."""
    config = SchedulerConfig(4, 8, 32, num_speculative_tokens=3, draft_lookahead=2)
    sched = Scheduler(config, BlockPool(16))
    seq = _seq("a", 4)
    seq.max_model_len = max_model_len
    sched.add(seq)
    sched.update(sched.schedule(), {"a": 7})
    assert len(seq.block_ids) == 1
    (item,) = sched.schedule().scheduled
    assert item.draft_room == room
    assert len(seq.block_ids) == blocks  # 4 + 1 + room (+ 2, within the length) tokens
    sched.abort(["a"])
    _assert_empty(sched)


def test_a_verification_planned_ahead_starts_where_none_were_accepted_then_resolves():
    """A verification planned before the one before it is read (StepPlan.shifted): each
    sequence starts where it would if that step kept none of its drafts, feeds the drafts made
    ahead (as many as its room allows then), and its blocks hold the furthest it can reach
    (every draft kept, then the lookahead). Once that step is read, `resolve` moves it by the
    drafts kept and keeps the drafts its room then leaves, as a plan made then would have."""
    config = SchedulerConfig(4, 8, 32, num_speculative_tokens=3, draft_lookahead=2)
    sched = Scheduler(config, BlockPool(32))
    a, b = _seq("a", 4, max_tokens=20), _seq("b", 4, max_tokens=7)
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), {"a": 7, "b": 7})
    plan = sched.schedule().with_drafts({"a": [3, 4, 5], "b": [3, 4, 5]})
    assert sched.schedule_ahead(plan) is None  # they could draft: not without their drafts
    ahead = sched.schedule_ahead(plan, {"a": 3, "b": 3})
    assert ahead.shifted
    assert [(i.start, i.num_new_tokens, i.draft_room, i.draft) for i in ahead.scheduled] == [
        (5, 4, 17, (-1, -1, -1)),  # room: 20 - 1 output tokens - 2
        (5, 4, 4, (-1, -1, -1)),  # room: 7 - 1 - 2
    ]
    assert len(a.block_ids) == len(b.block_ids) == 4  # 5 + 3 kept + 1 + 3 fed + 2 ahead
    sched.update(plan, {"a": 8, "b": 8}, {"a": 3, "b": 2})
    resolved = sched.resolve(ahead, {"a": 3, "b": 2}, {"a": [6, 9, 10], "b": [6, 9, 10]})
    # b holds 4 of its 7 tokens now: room for 2 drafts before its last, as a plan made now.
    assert [(i.start, i.draft) for i in resolved.scheduled] == [(8, (6, 9, 10)), (7, (6, 9))]
    finished = sched.update(resolved, {"a": 11, "b": 11}, {"a": 0, "b": 2})
    assert finished == [b] and b.output_ids == [7, 3, 4, 8, 6, 9, 11]  # its 7 tokens
    sched.abort(["a"])
    _assert_empty(sched)


def test_no_verification_planned_ahead_where_its_drafts_could_pass_the_context():
    config = SchedulerConfig(4, 8, 32, num_speculative_tokens=3, draft_lookahead=2)
    sched = Scheduler(config, BlockPool(32))
    seq = _seq("a", 4, max_tokens=20)
    seq.max_model_len = 10
    sched.add(seq)
    sched.update(sched.schedule(), {"a": 7})
    plan = sched.schedule().with_drafts({"a": [3, 4, 5]})
    computed, blocks = seq.num_computed, list(seq.block_ids)
    # 5 tokens, up to 4 more from `plan`: a draft after them could sit at position 10.
    assert sched.schedule_ahead(plan, {"a": 3}) is None
    assert (seq.num_computed, seq.block_ids) == (computed, blocks)
    sched.update(plan, {"a": 8}, {"a": 0})
    sched.abort(["a"])
    _assert_empty(sched)
