"""Tensor parallelism on the CPU (gloo): rank processes started by the engine, TP N == TP 1."""

import dataclasses
import time

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.fp8 import Fp8Scheme
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpeculativeConfig
from engine.tensor_parallel import TpShape
from engine.tests.tiny_hf import hf_deepseek, hf_model
from tools.fp8_checkpoint import quantize_folder

GREEDY = SamplingParams(temperature=0.0)
# Staggered lengths, one longer than a prefill chunk: chunked prefill, mixed and decode steps.
PROMPTS = [[1, 5, 9, 200, 3000], list(range(100, 160)), [11, 12, 13], [42] * 17]


def _config(model: str = "random:tiny-kv4", tp: int = 1, **kw) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype="float32",
        kv_cache_gb=0.01,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        tensor_parallel_size=tp,
        **kw,
    )


def _run(config: EngineConfig, prompts=PROMPTS, max_tokens: int = 24):
    """(greedy outputs, the engine's speculation counters)."""
    engine = LLMEngine.build(config)
    try:
        stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
        out = engine.generate(prompts, GREEDY, stop)
        assert engine.pool.num_free == engine.kv_cache.num_blocks  # every block back
        return out, engine.spec_stats
    finally:
        engine.close()


def _generate(config: EngineConfig, prompts=PROMPTS, max_tokens: int = 24) -> list[list[int]]:
    return _run(config, prompts, max_tokens)[0]


@pytest.fixture(scope="module")
def tp1_output() -> list[list[int]]:
    return _generate(_config())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_output_equals_tp1_batched(tp, tp1_output):
    assert _generate(_config(tp=tp)) == tp1_output
    assert len({t for out in tp1_output for t in out}) > 10  # not one token repeated


def test_kv_heads_replicated_over_more_ranks_equals_tp1():
    # 2 KV heads over 4 ranks: each head on two ranks, each rank one query head.
    prompts = [[1, 5, 9, 200, 30], list(range(100, 160))]
    one = _generate(_config("random:tiny"), prompts)
    assert _generate(_config("random:tiny", tp=4), prompts) == one


def test_tp2_with_steps_planned_ahead_equals_tp1(tp1_output):
    # Async scheduling: a step's input ids are the tokens rank 0 sampled in the step before,
    # still on its device, broadcast to the other ranks.
    assert _generate(_config(tp=2, async_scheduling=True)) == tp1_output


@pytest.mark.parametrize("tp", [2, 4])
def test_mla_moe_tp_output_equals_tp1(tp):
    # Heads and experts' channels split, the latent and the router replicated; chunked prefill.
    prompts = [[1, 5, 9, 200, 30], list(range(100, 160)), [11, 12, 13]]
    one = _generate(_config("random:deepseek-tiny"), prompts)
    assert _generate(_config("random:deepseek-tiny", tp=tp), prompts) == one


@pytest.mark.parametrize("kind", ["qwen2", "deepseek"])
def test_tp2_from_a_checkpoint_equals_tp1(tmp_path, kind):
    # Qwen2: biases on q/k/v (split with their heads); DeepSeek without a q bottleneck (q_proj
    # split by heads, kv_b_proj too, experts by channels); a vocabulary of 96 split in two.
    hf = hf_model("qwen2") if kind == "qwen2" else hf_deepseek(q_lora_rank=None)
    hf.save_pretrained(tmp_path)
    prompts = [[3, 7, 11, 50], [9] * 20]
    one = _generate(_config(str(tmp_path)), prompts)
    assert _generate(_config(str(tmp_path), tp=2), prompts) == one


def test_tp2_with_prefix_caching_equals_tp1(tp1_output):
    # The prompts again: their cached blocks hold every rank's heads of their KV.
    engine = LLMEngine.build(_config(tp=2, enable_prefix_caching=True))
    try:
        stop = StopConditions(max_tokens=24, ignore_eos=True)
        for _ in range(2):
            assert engine.generate(PROMPTS, GREEDY, stop) == tp1_output
        assert engine.scheduler.prefix_cache.hit_tokens >= 48  # the 60-token prompt's blocks
        assert engine.pool.num_free == engine.kv_cache.num_blocks
    finally:
        engine.close()


def _prompt_logprobs(config: EngineConfig, prompt: list[int]) -> tuple:
    """The prompt's log-probabilities (3 most likely tokens), in chunks of 32."""
    engine = LLMEngine.build(config)
    try:
        engine.add_request("p", prompt, SamplingParams(prompt_logprobs=3), StopConditions(1))
        outputs = []
        while engine.has_unfinished:
            outputs += engine.step()
        [out] = outputs
        assert engine.pool.num_free == engine.kv_cache.num_blocks
        return out.prompt_logprobs
    finally:
        engine.close()


def test_tp2_prompt_logprobs_equal_tp1():
    # Each slice of the logits is gathered over the ranks, as the sampled row's is.
    one, two = (_prompt_logprobs(_config(tp=tp), PROMPTS[1]) for tp in (1, 2))
    assert len(one) == len(PROMPTS[1]) - 1
    assert [(e.rank, e.top_token_ids) for e in two] == [(e.rank, e.top_token_ids) for e in one]
    assert [e.logprob for e in two] == pytest.approx([e.logprob for e in one], abs=1e-5)


def test_fp8_weights_tp2_equal_tp1():
    # Random weights quantized as a checkpoint's (64x64 blocks), each rank's part cut from it
    # with its scales: whole blocks of every split matrix.
    prompts = [[1, 5, 9, 200, 30], list(range(100, 160))]
    one = _generate(_config("random:tiny-kv4-fp8"), prompts)
    assert _generate(_config("random:tiny-kv4-fp8", tp=2), prompts) == one


@pytest.mark.parametrize("blocks", [(8, 8), (None, None)], ids=["blocks", "per-tensor"])
def test_deepseek_fp8_checkpoint_tp2_equals_tp1(tmp_path, blocks):
    # Every projection fp8 (q_proj, kv_b_proj and o_proj split by heads, the latent's
    # replicated, experts by channels); 8x8 blocks cut with the matrices, or one scale a tensor
    # that every rank keeps.
    hf_deepseek(q_lora_rank=None).save_pretrained(tmp_path / "src")
    quantize_folder(tmp_path / "src", tmp_path / "fp8", Fp8Scheme(*blocks))
    prompts = [[3, 7, 11, 50], [9] * 20]
    one = _generate(_config(str(tmp_path / "fp8")), prompts)
    assert _generate(_config(str(tmp_path / "fp8"), tp=2), prompts) == one


def test_tp2_ngram_speculation_equals_tp1():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    prompts = [[5, 6, 7, 8] * 6, [1, 2, 3]]
    one = _generate(_config(speculative_config=spec), prompts)
    assert _generate(_config(tp=2, speculative_config=spec), prompts) == one


def test_tp2_with_a_draft_model_on_rank_0_equals_tp1(tp1_output):
    # The draft runs whole on rank 0, its KV cache there alone (no rank > 0 holds any); the
    # ranks verify its proposals together. The draft is the target's own weights: every
    # proposal accepted, as at TP 1.
    spec = SpeculativeConfig("draft_model", 3, model="random:tiny-kv4")
    out, stats = _run(_config(tp=2, speculative_config=spec))
    assert out == tp1_output
    assert stats.num_draft_tokens > 3 * len(PROMPTS)
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize(
    "target, spec",
    [
        ("random:deepseek-tiny", SpeculativeConfig("mtp", 3)),
        ("random:tiny-8l", SpeculativeConfig("eagle3", 3, model="random:eagle3-tiny")),
    ],
    ids=["mtp", "eagle3"],
)
def test_tp2_with_a_hidden_state_proposer_on_rank_0_equals_tp1(target, spec):
    # MTP layers, or an EAGLE-3 head, whole on rank 0: fed its hidden states (every rank's are
    # the same), looking tokens up in the target's embedding gathered whole there. Output
    # unchanged by speculation; and where a simulated acceptance curve takes drafts as output
    # tokens, the same as at TP 1: the same drafts.
    prompts = [[1, 5, 9, 200, 30], list(range(100, 160)), [11, 12, 13]]
    plain = _generate(_config(target), prompts)
    out, stats = _run(_config(target, tp=2, speculative_config=spec), prompts)
    assert out == plain and stats.num_draft_tokens > 0
    curve = dataclasses.replace(spec, acceptance_curve="mean-2.5-depth-3")
    drafts = [
        _run(_config(target, tp=tp, speculative_config=curve, benchmark_mode=True), prompts)
        for tp in (1, 2)
    ]
    assert drafts[0][0] == drafts[1][0] != plain
    assert drafts[1][1].num_accepted_tokens == drafts[0][1].num_accepted_tokens > 0


def test_a_rank_that_dies_fails_the_engine_naming_it():
    engine = LLMEngine.build(_config(tp=2))
    try:
        stop = StopConditions(max_tokens=10**6, ignore_eos=True)
        engine.add_request("r", [1, 2, 3], GREEDY, stop)
        engine.step()
        engine.tp_workers._procs[0].kill()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            while True:
                engine.step()
        assert time.monotonic() - started < 5
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            engine.check_ranks()  # as the engine's thread finds it between steps
    finally:
        engine.close()


def test_configurations_that_do_not_split_are_refused_before_starting():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 and the model's 4 KV heads"):
        LLMEngine.build(_config(tp=3))
    with pytest.raises(ValueError, match=r"does not divide the model's num_heads \(4\)"):
        LLMEngine.build(_config("random:deepseek-tiny", tp=8))
    with pytest.raises(
        ValueError,
        match=r"each rank's part of k_proj and v_proj is 32 rows, not a multiple of the fp8 "
        r"scale blocks' 64 \(weight_block_size \[64, 64\]\); tensor_parallel_size 1, 2 would",
    ):
        LLMEngine.build(_config("random:tiny-kv4-fp8", tp=4))
    if torch.cuda.device_count() < 2:  # this machine: too few GPUs for two ranks
        with pytest.raises(ValueError, match="needs devices up to cuda:1; this machine has"):
            LLMEngine.build(_config(tp=2, device="cuda"))


def test_vocabulary_rows_are_split_with_the_last_rank_padded():
    config = ModelConfig.preset("tiny")  # vocabulary 256
    weight = torch.arange(255 * 3, dtype=torch.float32).view(255, 3)
    config = config.__class__(**{**config.__dict__, "vocab_size": 255})
    first, last = (TpShape(config, r, 2).shard("lm_head.weight", weight) for r in (0, 1))
    assert first.shape == last.shape == (128, 3)
    assert torch.equal(torch.cat([first, last[:127]]), weight)
    assert not last[127].any()  # the padding row: its logit is cut before sampling
