"""The n choices of one prefilled prompt (OpenAI's n) through the whole engine (random tiny
model, CPU): a group admitted with `add_prefilled_choices` gives each choice exactly the tokens
of a request of its own, prefilled separately and started from the same first token with the
same seed (seed + i for choice i), whether the prompt ends in a partial block (copied per
choice) or fills its blocks exactly (all shared), and when no block is free for a copy (the
choice recomputes its prompt). Every test ends with the pool's free count back to its total.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, Sequence, StopConditions

torch.set_num_threads(1)

BLOCK = 16
PROMPT = [(7 * i + 3) % 256 for i in range(40)]
PARTIAL, EXACT = 21, 2 * BLOCK  # prompt lengths: a partial last block, or none
FIRSTS = [7, 42, 99]
SAMPLED = SamplingParams(temperature=0.05, seed=1234)  # low: the tiny model's logits are flat
STOP = StopConditions(max_tokens=8, ignore_eos=True)
CONFIG = EngineConfig(model="random:tiny", dtype="float32", block_size=BLOCK, kv_cache_gb=0.01)


@pytest.fixture(scope="module")
def prefill() -> LLMEngine:
    return LLMEngine.build(CONFIG)


@pytest.fixture()
def engine(prefill):
    """The decode engine (same weights as `prefill`), checked empty afterwards."""
    engine = LLMEngine.build(CONFIG)
    yield engine
    assert not engine.has_unfinished and not engine.sequences
    assert engine.pool.num_free == engine.pool.num_total
    assert all(engine.pool.refcount(i) == 0 for i in range(engine.pool.num_total))


def _ticket(prefill: LLMEngine, engine: LLMEngine, prompt: list[int]) -> list[int]:
    """Blocks of `engine` holding the prompt's KV, as the transport leaves them."""
    seq = prefill.add_request("p", prompt, SamplingParams(), StopConditions(max_tokens=2))
    prefill.step()
    blocks = engine.pool.allocate(len(seq.block_ids))
    engine.kv_cache.storage[:, :, blocks] = prefill.kv_cache.storage[:, :, seq.block_ids]
    assert prefill.abort("p")
    return blocks


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished:
        engine.step()


def _alone(prefill, engine, prompt, first: int, sampling: SamplingParams) -> list[int]:
    """The tokens of a request of its own, prefilled separately, started from `first`."""
    [seq] = engine.new_choices("alone", prompt, sampling, STOP, 1)
    assert engine.add_prefilled(seq, _ticket(prefill, engine, prompt), first)
    _run(engine)
    return seq.output_ids


def _shared(engine: LLMEngine, seqs: list[Sequence], num_prompt: int) -> None:
    """Every choice holds the prompt's full blocks, and a partial last one of its own."""
    full = num_prompt // BLOCK
    for seq in seqs:
        assert seq.block_ids[:full] == seqs[0].block_ids[:full]
        assert all(engine.pool.refcount(b) == len(seqs) for b in seqs[0].block_ids[:full])
    if num_prompt % BLOCK:
        own = [seq.block_ids[full] for seq in seqs]
        assert len(set(own)) == len(seqs) and all(engine.pool.refcount(b) == 1 for b in own)
    else:
        assert all(len(seq.block_ids) == full for seq in seqs)


def test_choices_have_their_own_ids_and_seeds(engine):
    top = replace(SAMPLED, seed=2**64 - 1)
    seqs = engine.new_choices("x", PROMPT[:5], top, STOP, 3)
    assert [s.seq_id for s in seqs] == ["x#0", "x#1", "x#2"]
    assert [s.sampling.seed for s in seqs] == [2**64 - 1, 0, 1]  # mod 2**64
    [greedy] = engine.new_choices("y", PROMPT[:5], SamplingParams(), STOP, 1)
    assert greedy.seq_id == "y#0" and greedy.sampling.seed is None and greedy.generator is None


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_prompt", [PARTIAL, EXACT])
def test_each_choice_equals_a_request_of_its_own(prefill, engine, num_prompt, async_scheduling):
    engine.async_scheduling = async_scheduling
    prompt = PROMPT[:num_prompt]
    seqs = engine.new_choices("r", prompt, SAMPLED, STOP, len(FIRSTS))
    blocks = _ticket(prefill, engine, prompt)
    free = engine.pool.num_free
    assert engine.add_prefilled_choices(seqs, blocks, FIRSTS) == [True] * len(FIRSTS)
    _shared(engine, seqs, num_prompt)
    copies = len(FIRSTS) - 1 if num_prompt % BLOCK else 0
    assert engine.pool.num_free == free - copies
    _run(engine)
    outputs = [seq.output_ids for seq in seqs]
    for i, first in enumerate(FIRSTS):
        seeded = replace(SAMPLED, seed=SAMPLED.seed + i)
        assert outputs[i] == _alone(prefill, engine, prompt, first, seeded)
    assert len({tuple(out[1:]) for out in outputs}) == len(FIRSTS)  # their own random streams


def test_greedy_choices_from_one_first_token_are_identical(prefill, engine):
    prompt = PROMPT[:PARTIAL]
    seqs = engine.new_choices("g", prompt, SamplingParams(), STOP, 2)
    assert engine.add_prefilled_choices(seqs, _ticket(prefill, engine, prompt), [42, 42])
    _run(engine)
    alone = _alone(prefill, engine, prompt, 42, SamplingParams())
    assert seqs[0].output_ids == seqs[1].output_ids == alone


def test_a_choice_without_a_free_block_for_its_copy_recomputes_its_prompt(prefill, engine):
    prompt = PROMPT[:PARTIAL]
    seqs = engine.new_choices("f", prompt, SAMPLED, STOP, 2)
    blocks = _ticket(prefill, engine, prompt)
    hog = engine.pool.allocate(engine.pool.num_free)
    assert engine.add_prefilled_choices(seqs, blocks, FIRSTS[:2]) == [True, True]
    assert seqs[0].block_ids == blocks and seqs[0].num_computed == PARTIAL
    assert seqs[1].block_ids == [] and seqs[1].num_computed == 0
    assert seqs[1].output_ids == [FIRSTS[1]]
    assert all(engine.pool.refcount(b) == 1 for b in blocks)  # no reference left behind
    engine.pool.free(hog)
    _run(engine)
    for i, seq in enumerate(seqs):
        seeded = replace(SAMPLED, seed=SAMPLED.seed + i)
        assert seq.output_ids == _alone(prefill, engine, prompt, FIRSTS[i], seeded)


def test_choices_ending_first_leave_the_shared_blocks_to_the_others(prefill, engine):
    """Choice 0 stops on its first token (its blocks go, the shared ones stay), choice 1 is
    aborted after a step: choice 2 goes on alone to the tokens of a request of its own."""
    engine.async_scheduling = False  # no step ahead still writing choice 1's blocks
    prompt = PROMPT[:PARTIAL]
    stop = replace(STOP, stop_token_ids=(FIRSTS[0],))
    seqs = engine.new_choices("e", prompt, SamplingParams(), stop, 3)
    blocks = _ticket(prefill, engine, prompt)
    assert engine.add_prefilled_choices(seqs, blocks, FIRSTS) == [False, True, True]
    assert seqs[0].finish_reason is FinishReason.STOP and seqs[0].block_ids == []
    assert engine.pool.refcount(blocks[0]) == 2 and engine.pool.refcount(blocks[1]) == 0
    engine.step()
    assert engine.abort("e#1") and seqs[1].finish_reason is FinishReason.ABORT
    assert engine.pool.refcount(blocks[0]) == 1
    _run(engine)
    assert seqs[2].output_ids == _alone(prefill, engine, prompt, FIRSTS[2], SamplingParams())


def test_choices_running_and_waiting_abort_together(engine):
    """`abort_all` ends every unfinished sequence among its ids, running or waiting, once each:
    an id given twice, an unknown one and one ended before change nothing."""
    running = engine.new_choices("g", PROMPT[:PARTIAL], SamplingParams(), STOP, 3)
    for seq in running:
        engine.add_sequence(seq)
    engine.step()
    waiting = engine.new_choices("h", PROMPT[:EXACT], SamplingParams(), STOP, 3)
    for seq in waiting:
        engine.add_sequence(seq)
    assert all(seq.num_output_tokens == 1 for seq in running)
    assert all(seq.num_output_tokens == 0 for seq in waiting)
    assert engine.abort("g#0")
    ids = [seq.seq_id for seq in running + waiting]
    aborted = engine.abort_all([*ids, "g#1", "nobody"])
    assert sorted(aborted) == sorted(ids[1:])
    assert all(seq.finish_reason is FinishReason.ABORT for seq in running + waiting)
    assert engine.abort_all(ids) == []
