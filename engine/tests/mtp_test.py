"""Multi-token prediction on the CPU, deepseek-tiny (random, one MTP layer), float32:
- greedy output with MTP speculation equals output without it, batched, with chunked prefill
  and preemption, and the block pool is all free afterwards;
- the incremental bookkeeping (hidden states recorded step by step, the MTP cache caught up
  in pieces) proposes what one pass over the whole sequence predicts;
- the layer loads from a checkpoint folder (its tensors under model.layers.<num_layers>.);
- a model without MTP layers is refused, naming the alternatives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.hidden_proposer import drafting_rows
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import Sequence, StopConditions
from engine.speculative import SpeculativeConfig
from engine.step_plan import ScheduledSeq, StepPlan
from engine.tests.tiny_hf import add_mtp_layer, hf_deepseek

MTP = SpeculativeConfig("mtp", 3)
# Token ids within every model's vocabulary here (the Hugging Face folder's is 96).
PROMPTS = [[5, 17, 3, 9], list(range(1, 40)), [9] * 30, list(range(30, 90, 3))]


def _engine(**overrides) -> LLMEngine:
    config = dict(model="random:deepseek-tiny", dtype="float32", block_size=8, kv_cache_gb=0.01)
    return LLMEngine.build(EngineConfig(**{**config, **overrides}))


def _run(engine: LLMEngine, max_tokens: int = 20) -> list[list[int]]:
    seqs = [
        engine.add_request(f"r{i}", p, SamplingParams(), StopConditions(max_tokens - 2 * i))
        for i, p in enumerate(PROMPTS)
    ]
    while engine.has_unfinished:
        engine.step()
    assert engine.pool.num_free == engine.pool.num_total
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _run(_engine())


def test_mtp_greedy_equals_decoding_without_speculation(reference):
    engine = _engine(speculative_config=MTP)
    assert _run(engine) == reference
    assert engine.spec_stats.num_drafts > 0


def test_mtp_with_chunked_prefill_and_preemption(reference):
    # 12 tokens per forward chunks the prompts; 10 blocks of 8 (target and MTP latents) cannot
    # hold all four.
    config = ModelConfig.preset("deepseek-tiny")
    layers = dataclasses.replace(config, num_layers=config.num_layers + config.num_mtp_layers)
    per_block = layers.kv_bytes_per_token(torch.float32) * 8
    engine = _engine(
        speculative_config=MTP,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        kv_cache_gb=10 * per_block / 2**30,
    )
    assert engine.pool.num_total == 10
    assert _run(engine) == reference
    assert engine.scheduler.num_preemptions > 0 and engine.spec_stats.num_drafts > 0


def test_incremental_proposals_equal_one_pass_over_the_sequence():
    """After prefill in chunks and a few speculative steps, draft 1 equals the MTP layer's
    argmax over the whole sequence in one pass: target hidden states of every position (a
    fresh prefill), then the layer over every (token j + 1, h_j)."""
    engine = _engine(speculative_config=MTP, max_num_batched_tokens=16, max_num_seqs=4)
    engine.add_request("r", PROMPTS[1], SamplingParams(), StopConditions(max_tokens=30))
    proposals = []
    original = engine.proposer.propose

    def spy(seqs, rooms):
        drafts = original(seqs, rooms)
        proposals.append((list(seqs[0].token_ids), drafts[0]))
        return drafts

    engine.proposer.propose = spy
    for _ in range(6):
        engine.step()
    assert len(proposals) >= 3
    for tokens, drafts in proposals[-2:]:
        assert drafts[0] == _one_pass_draft(engine, tokens)


def test_drafts_made_ahead_equal_drafts_made_after_the_results_are_read():
    """The MTP layer drafts each step's successor as soon as the step is launched, from its
    results on the device (HiddenStateProposer.draft_ahead): every proposal equals the one made
    from the host after the results are read. Drafts are accepted as a curve draws (0 to 3 a
    step), so the drafts ahead start at each of those offsets; batched, the long prompt
    prefilled in chunks."""
    spec = dataclasses.replace(MTP, acceptance_curve="mean-2.5-depth-3")
    runs = {}
    for ahead in (False, True):
        engine = _engine(
            speculative_config=spec, benchmark_mode=True, max_num_batched_tokens=16, max_num_seqs=4
        )
        if not ahead:
            engine.proposer.draft_ahead = lambda step: None
        proposals, original = [], engine.proposer.propose

        def spy(seqs, rooms, original=original, proposals=proposals):
            drafts = original(seqs, rooms)
            proposals.append({s.seq_id: d for s, d in zip(seqs, drafts, strict=True)})
            return drafts

        engine.proposer.propose = spy
        launched, draft_ahead = [0], engine.proposer.draft_ahead

        def count(step, draft_ahead=draft_ahead, launched=launched, proposer=engine.proposer):
            draft_ahead(step)
            launched[0] += proposer.ahead_of(step) is not None

        engine.proposer.draft_ahead = count
        runs[ahead] = (_run(engine), proposals, launched[0], engine.spec_stats)
    (outputs, proposals, _, stats), (ahead_outputs, ahead_proposals, launched, ahead_stats) = (
        runs[False],
        runs[True],
    )
    assert ahead_proposals == proposals
    assert ahead_outputs == outputs
    assert launched >= 5  # the steps after the last prompt's prefill (none rides along)
    assert ahead_stats == stats
    assert any(stats.accepted_per_position)  # drafts were accepted: offsets past 0


@pytest.mark.parametrize("curve", [None, "mean-2.5-depth-3"])
def test_verifications_planned_ahead_equal_those_planned_after_the_results_are_read(curve):
    """With async scheduling each verification is followed by the next one, launched before
    the host reads it: fed the drafts made on the device, at positions moved there by the
    drafts it accepted (StepPlan.shifted). Output and acceptance equal the engine's that reads
    each step first (greedy: the output without speculation), in a cache small enough to
    preempt; the pool all free after."""
    spec = dataclasses.replace(MTP, acceptance_curve=curve)
    config = dict(speculative_config=spec, benchmark_mode=curve is not None)
    config.update(max_num_batched_tokens=16, max_num_seqs=4)
    runs = []
    for async_scheduling in (False, True):
        engine = _engine(**config, async_scheduling=async_scheduling)
        launch, shifted = engine.runner.launch, []

        def counted(plan, *args, launch=launch, shifted=shifted, **kwargs):
            shifted.append(plan.shifted)
            return launch(plan, *args, **kwargs)

        engine.runner.launch = counted
        runs.append((_run(engine, max_tokens=40), engine.spec_stats, sum(shifted)))
    (outputs, stats, none), (ahead_outputs, ahead_stats, ahead) = runs
    assert ahead_outputs == outputs and ahead_stats == stats
    assert none == 0 and ahead >= 10
    if curve is None:
        assert outputs == _run(_engine(), max_tokens=40)
    else:
        assert any(stats.accepted_per_position)  # every shift occurs


def test_an_abort_under_a_verification_planned_ahead_leaves_the_rest_and_the_pool_whole():
    """A sequence aborted while a verification planned ahead with it is in flight: its blocks
    come back once that step is read, the others' output is what it is without the abort
    (each sequence's acceptance its own), and the aborted one's a prefix of its own."""
    spec = dataclasses.replace(MTP, acceptance_curve="mean-2.5-depth-3")
    config = dict(speculative_config=spec, benchmark_mode=True, max_num_batched_tokens=16)
    expected = _run(_engine(**config, max_num_seqs=4), max_tokens=40)
    engine = _engine(**config, max_num_seqs=4, async_scheduling=True)
    launch, shifted = engine.runner.launch, []

    def counted(plan, *args, **kwargs):
        shifted.append(plan.shifted and any(i.seq.seq_id == "r1" for i in plan.scheduled))
        return launch(plan, *args, **kwargs)

    engine.runner.launch = counted
    seqs = [
        engine.add_request(f"r{i}", p, SamplingParams(), StopConditions(40 - 2 * i))
        for i, p in enumerate(PROMPTS)
    ]
    aborted = False
    while engine.has_unfinished:
        engine.step()
        if not aborted and shifted[-1]:
            aborted = engine.abort("r1")
    assert aborted
    assert engine.pool.num_free == engine.pool.num_total
    outputs = [s.output_ids for s in seqs]
    assert outputs[:1] + outputs[2:] == expected[:1] + expected[2:]
    assert outputs[1] == expected[1][: len(outputs[1])] and len(outputs[1]) < len(expected[1])


def _one_pass_draft(engine: LLMEngine, tokens: list[int]) -> int:
    """The MTP layer's greedy token after `tokens`, from scratch, in blocks no one uses."""
    n = len(tokens)
    blocks = engine.pool.allocate(-(-n // engine.kv_cache.block_size))
    try:
        meta = AttentionMetadata.build([n - 1], [n - 1], [blocks], engine.kv_cache.block_size)
        model = engine.runner.model
        hidden = model(
            torch.tensor(tokens[:-1]), torch.arange(n - 1), engine.kv_cache.kv_caches, meta
        )
        mtp = engine.proposer
        _, logits = mtp.layers[0].predict(
            model, torch.tensor(tokens[1:]), torch.arange(n - 1), hidden,
            mtp.kv_cache.kv_caches[0], meta,
        )  # fmt: skip
        return int(logits[-1].argmax())
    finally:
        engine.pool.free(blocks)


def test_mtp_layer_loads_from_a_checkpoint_folder(tmp_path):
    """A Hugging Face DeepSeek-V3 folder with one MTP layer's tensors added under
    model.layers.<num_layers>. (its copy of the embedding too, left out): the engine's layer
    holds exactly those tensors, and decodes greedy as without speculation."""
    hf_deepseek(q_lora_rank=24).save_pretrained(tmp_path)
    layer = add_mtp_layer(tmp_path)
    loaded = _engine(model=str(tmp_path), speculative_config=MTP)
    ours = dict(loaded.proposer.layers[0].named_parameters())
    for name, param in layer.named_parameters():
        assert torch.equal(ours[name], param), name
    plain = _engine(model=str(tmp_path))
    assert _run(loaded) == _run(plain)
    assert loaded.spec_stats.num_drafts > 0


def test_a_model_without_mtp_layers_is_refused():
    with pytest.raises(ValueError, match="has no multi-token-prediction layers"):
        _engine(model="random:tiny", speculative_config=MTP)


def testdrafting_rows_skip_what_rides_along():
    """The rows draft_ahead feeds again: each drafting sequence's fed rows in the forward and in
    the verified logits (a sampling prompt chunk before it has many fed rows and one verified;
    a decode without drafts one of each), and its index among the sampling sequences; a
    sequence with target states still pending is left out."""
    seqs = [
        Sequence(f"s{i}", list(range(1, 20)), SamplingParams(), StopConditions(8), [], 64)
        for i in range(4)
    ]
    for seq in seqs:
        seq.num_draft_computed = 10
    seqs[3].draft_hidden = torch.zeros(1, 4)
    plan = StepPlan(
        (
            ScheduledSeq(seqs[0], 2, 8, True),  # a prompt's last chunk: 8 rows, 1 verified
            ScheduledSeq(seqs[1], 10, 1, True),  # a decode without drafts
            ScheduledSeq(seqs[2], 10, 3, True, 2, (7, 8)),
            ScheduledSeq(seqs[3], 10, 3, True, 2, (7, 8)),  # states pending
        ),
        (),
    )
    assert [(item.seq.seq_id, *rows) for item, *rows in drafting_rows(plan)] == [("s2", 9, 2, 2)]
