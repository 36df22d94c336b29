"""Prefix caching (engine/prefix_cache.py): the pool's named blocks, and an engine that reuses
the KV of full blocks its prompts share with earlier ones, with output unchanged (float32 tiny
Llama, greedy) and the block pool all free after every test."""

import pytest
import torch

from engine.kv_cache import BlockPool
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0)
STOP = StopConditions(max_tokens=12, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # random:tiny: layers x K,V x KV heads x dim x fp32


def test_a_named_block_is_found_after_its_free_until_the_pool_hands_it_out():
    pool = BlockPool(8)
    ids = pool.allocate(3)
    pool.name(ids[0], b"a")
    pool.name(ids[1], b"b")
    pool.name(ids[2], b"a")  # a name held stays its first block's
    pool.free(ids)
    assert pool.num_free == 8
    assert pool.lookup([b"a", b"b", b"c"]) == ids[:2]  # the longest run from the first
    assert pool.num_free == 6 and pool.refcount(ids[0]) == 1
    assert pool.lookup([b"b"]) == [ids[1]] and pool.refcount(ids[1]) == 2
    pool.free([ids[0], ids[1], ids[1]])
    assert pool.allocate(8) is not None  # every block handed out: names forgotten
    assert pool.lookup([b"a"]) == [] and pool.num_free == 0


def test_allocations_take_unnamed_blocks_first_then_the_least_recently_freed_named():
    pool = BlockPool(8)
    ids = pool.allocate(8)
    pool.name(2, b"x")
    pool.name(5, b"y")
    pool.free([5])
    pool.free([2])  # freed after 5: kept longer
    pool.free([0, 1, 3, 4, 6, 7])
    assert pool.num_free == 8
    assert pool.allocate(6) == [0, 1, 3, 4, 6, 7]  # the runs first: both names kept
    assert pool.lookup([b"y"]) == [5]
    pool.free([5])  # now the most recently freed
    assert pool.allocate(1) == [2]  # the least recently freed goes, and its name with it
    assert pool.lookup([b"x"]) == [] and pool.lookup([b"y"]) == [5]
    assert pool.num_free == 0 and pool.allocate(1) is None
    pool.free(ids)
    assert pool.num_free == 8 and sorted(pool.allocate(8)) == ids


def _engine(cache: bool, kv_blocks: int = 64, **kw) -> LLMEngine:
    return LLMEngine.build(
        EngineConfig(
            model="random:tiny",
            dtype="float32",
            block_size=BLOCK,
            kv_cache_gb=kv_blocks * BLOCK_BYTES / 2**30,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            enable_prefix_caching=cache,
            **kw,
        )
    )


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    out = engine.generate(prompts, GREEDY, STOP)
    assert engine.pool.num_free == engine.kv_cache.num_blocks
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_shared_prefix_is_computed_once_and_the_output_is_unchanged(async_scheduling):
    # Async: blocks are named when a step is updated, after the next one was launched.
    prefix = _prompt(0, 40)  # two full blocks, and 8 tokens of a third
    first, second = prefix + _prompt(1, 9), prefix + _prompt(2, 30)
    plain = _engine(cache=False)
    expected = [_run(plain, [p])[0] for p in (first, second, second)]
    engine = _engine(cache=True, async_scheduling=async_scheduling)
    cache = engine.scheduler.prefix_cache
    assert _run(engine, [first]) == expected[:1] and cache.hit_tokens == 0
    assert _run(engine, [second]) == expected[1:2]
    assert cache.hit_tokens == 32  # the prefix's full blocks
    # The same prompt again: every full block but the one holding its last token.
    assert _run(engine, [second]) == expected[2:]
    assert cache.hit_tokens == 32 + (len(second) - 1) // BLOCK * BLOCK
    assert cache.queried_tokens == len(first) + 2 * len(second)


def test_blocks_handed_out_again_are_not_found_and_preempted_sequences_find_their_own():
    # 10 blocks: a 70-token prompt growing to 82 takes 6; four at once preempt each other.
    prompts = [_prompt(seed, 70) for seed in range(4)]
    plain = _engine(cache=False, kv_blocks=10)
    expected = _run(plain, prompts)
    assert plain.scheduler.num_preemptions > 0
    engine = _engine(cache=True, kv_blocks=10)
    assert _run(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    hits = engine.scheduler.prefix_cache.hit_tokens
    assert hits > 0  # a preempted sequence re-admitted with its blocks still cached
    # The last prompt's blocks were the last written; the first's have been handed out since.
    assert _run(engine, prompts[:1]) == expected[:1]
    assert engine.scheduler.prefix_cache.hit_tokens == hits


def test_a_draft_models_kv_of_cached_blocks_is_taken_with_the_targets():
    # The model drafting for itself: its proposals are all accepted only if the draft's KV of
    # the cached prefix is there, as the target's is.
    spec = SpeculativeConfig("draft_model", 3, model="random:tiny")
    prompt = _prompt(3, 70)
    expected = _run(_engine(cache=False), [prompt])
    engine = _engine(cache=True, speculative_config=spec)
    for _ in range(2):
        assert _run(engine, [prompt]) == expected
    assert engine.scheduler.prefix_cache.hit_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_mtp_layers_kv_of_cached_blocks_gives_the_same_drafts():
    # Under a simulated acceptance curve drafts become output tokens: the prompt sent again,
    # its prefix cached (the target's and the MTP layer's KV), gives the drafts it gave when
    # computed in full.
    spec = SpeculativeConfig("mtp", 3, acceptance_curve="mean-2.5-depth-3")
    prompt = _prompt(4, 70)

    def twice(cache: bool) -> tuple[list, int]:
        config = EngineConfig(
            model="random:deepseek-tiny", dtype="float32", block_size=BLOCK,
            kv_cache_gb=0.01, max_num_seqs=8, max_num_batched_tokens=32,
            speculative_config=spec, benchmark_mode=True, enable_prefix_caching=cache,
        )  # fmt: skip
        engine = LLMEngine.build(config)
        outputs = [_run(engine, [prompt]) for _ in range(2)]
        return outputs, engine.scheduler.prefix_cache.hit_tokens if cache else 0

    (first, second), _ = twice(cache=False)
    cached, hits = twice(cache=True)
    assert cached == [first, second] and hits == (len(prompt) - 1) // BLOCK * BLOCK
