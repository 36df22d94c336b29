"""Speculative decoding in the whole engine, on the bundled SmolLM2-135M-Instruct: greedy output
with each proposer equals output without speculation token for token (batched, with staggered
lengths, with chunked prefill and preemption), a draft identical to the target has every
proposal accepted, and the block pool is all free after every run and after aborts
mid-speculation. float32, so that greedy choices cannot flip on rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpeculativeConfig

MODEL = Path("tools/smollm2-135m-instruct")  # Bazel data: //tools:smollm2
NEW_TOKENS = 24
GREEDY = SamplingParams()
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
TEXTS = [
    # Repetitive: n-gram lookup finds what comes next.
    "Repeat this code exactly:\n" + CODE + "Here it is again:\n" + CODE[:20],
    "The quick brown fox",
    "1, 2, 3, 4, 5, 6,",
    "Once upon a time, in a land far away, there lived a",
]
NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=2)
SELF_DRAFT = SpeculativeConfig("draft_model", 3, model=str(MODEL))
EAGLE3 = SpeculativeConfig("eagle3", 3, model="random:eagle3-smollm2")
"""A random EAGLE-3 head of SmolLM2's shape, drafting from 12,000 of its tokens."""


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def _engine(**overrides) -> LLMEngine:
    config = dict(model=str(MODEL), dtype="float32", block_size=16, kv_cache_gb=0.25)
    return LLMEngine.build(EngineConfig(**{**config, **overrides}))


def _run(
    engine: LLMEngine, prompts: list[list[int]], sampling: list[SamplingParams] | None = None
) -> list[list[int]]:
    """Every prompt at once (prompt i with sampling[i], greedy by default), prompt i stopping
    after NEW_TOKENS - 5 * i tokens."""
    sampling = sampling or [GREEDY] * len(prompts)
    seqs = [
        engine.add_request(f"r{i}", p, sampling[i], StopConditions(max_tokens=NEW_TOKENS - 5 * i))
        for i, p in enumerate(prompts)
    ]
    streamed: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
    while engine.has_unfinished:
        for out in engine.step():
            streamed[out.seq_id].append(out.token_id)
    outputs = [s.output_ids for s in seqs]
    assert [streamed[s.seq_id] for s in seqs] == outputs  # every token reached the caller once
    assert not engine.sequences and engine.pool.num_free == engine.pool.num_total
    return outputs


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return _run(_engine(), prompts)


def test_ngram_greedy_equals_decoding_without_speculation(prompts, reference):
    engine = _engine(speculative_config=NGRAM)
    assert _run(engine, prompts) == reference
    stats = engine.spec_stats
    # The repeated code is proposed, and mostly accepted.
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > stats.num_draft_tokens / 3


def test_a_logit_biased_request_is_not_speculated_and_its_neighbours_are(prompts, reference):
    """Verification compares drafts with the logits as they are: a request with a logit bias
    decodes one token a step (vLLM refuses the two together), the others still speculate."""
    banned = reference[0][0]  # the repeated code's first token, which n-gram lookup proposes
    sampling = [SamplingParams(logit_bias={banned: -100.0})] + [GREEDY] * (len(prompts) - 1)
    expected = _run(_engine(), prompts, sampling)
    engine = _engine(speculative_config=NGRAM)
    outputs = _run(engine, prompts, sampling)
    assert outputs == expected and outputs[1:] == reference[1:]
    assert banned not in outputs[0] and outputs[0] != reference[0]
    assert engine.spec_stats.num_draft_tokens > 0


def test_a_draft_identical_to_the_target_has_every_proposal_accepted(prompts, reference):
    engine = _engine(speculative_config=SELF_DRAFT)
    assert _run(engine, prompts) == reference
    stats = engine.spec_stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # Depth 3 wherever the length limits leave room: close to 4 tokens per step.
    assert stats.mean_acceptance_length > 3.5


def test_a_different_draft_model_changes_no_token(prompts, reference):
    """Random weights of SmolLM2's shape: drafts almost never agree, every one is verified."""
    draft = SpeculativeConfig("draft_model", 2, model="random:smollm2-135m")
    engine = _engine(speculative_config=draft)
    assert _run(engine, prompts) == reference
    assert engine.spec_stats.num_draft_tokens > 2 * len(prompts)


def test_an_eagle3_head_changes_no_token(prompts, reference):
    """Its drafts come from the target's streams entering layers 2, 15 and 27 (random weights:
    they almost never agree), mapped from its 12,000-token vocabulary; every one verified."""
    engine = _engine(speculative_config=EAGLE3)
    assert engine.runner.model.model.aux_layers == (2, 15, 27)
    assert _run(engine, prompts) == reference
    assert engine.spec_stats.num_draft_tokens > 2 * len(prompts)


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT, EAGLE3], ids=["ngram", "draft", "eagle3"])
def test_chunked_prefill_and_preemption_with_speculation(prompts, reference, spec):
    # 20 tokens per forward chunks the long prompt; 9 blocks of 16 tokens (target and draft
    # KV together) cannot hold every sequence with its draft room: preemptions recompute
    # the target's and the draft's KV.
    target = 30 * 2 * 3 * 64 * 4 * 16  # layers * (K,V) * kv heads * head dim * fp32 * tokens
    extra = {"draft_model": target, "eagle3": target // 30}  # the draft's, the head's one layer
    per_block = target + extra.get(spec.method, 0)
    engine = _engine(
        speculative_config=spec,
        max_num_batched_tokens=20,
        max_num_seqs=4,
        kv_cache_gb=9 * per_block / 2**30,
    )
    assert engine.pool.num_total == 9
    assert _run(engine, prompts) == reference
    assert engine.scheduler.num_preemptions > 0


def test_logprobs_of_every_accepted_token_equal_decoding_without_speculation(prompts):
    """A sequence asking for log-probabilities speculates too: each token it gets, accepted
    draft or the target's own, carries the log-probabilities one-token decoding reports."""
    asked = SamplingParams(logprobs=3)
    runs = []
    for spec in (None, NGRAM):
        engine = _engine(speculative_config=spec)
        engine.add_request("r", prompts[0], asked, StopConditions(max_tokens=NEW_TOKENS))
        outs = []
        while engine.has_unfinished:
            outs += engine.step()
        runs.append((engine, outs))
    (_, plain), (engine, fast) = runs
    assert engine.spec_stats.num_accepted_tokens > 0
    assert [o.token_id for o in fast] == [o.token_id for o in plain]
    for ours, ref in zip(fast, plain, strict=True):
        assert ours.logprobs.top_token_ids == ref.logprobs.top_token_ids
        assert ours.logprobs.logprob == pytest.approx(ref.logprobs.logprob, abs=1e-4)


def test_aborts_mid_speculation_free_every_block(prompts):
    engine = _engine(speculative_config=SELF_DRAFT)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY, StopConditions(max_tokens=200))
    for _ in range(4):
        engine.step()
    assert engine.spec_stats.num_drafts > 0
    for i in range(len(prompts)):
        assert engine.abort(f"r{i}")
    assert not engine.has_unfinished
    assert engine.pool.num_free == engine.pool.num_total
