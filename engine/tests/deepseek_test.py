"""The DeepSeek-V3 family model against transformers: paged forwards, decode, the engine."""

import pytest
import torch

from engine.config import ModelConfig
from engine.deepseek import DeepseekForCausalLM
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.tests.tiny_hf import (
    VOCAB,
    PagedRunner,
    hf_deepseek,
    hf_deepseek_v2,
    hf_logits,
    rel_err,
)
from engine.weights import load_weights

TOL = 1e-4

MODELS = {
    "v3_q_lora": lambda: hf_deepseek(48),
    "v3_q_proj": lambda: hf_deepseek(None),
    "v2": hf_deepseek_v2,
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """(transformers model, its save_pretrained folder, our model loaded from the folder)."""
    torch.set_num_threads(1)
    hf = MODELS[request.param]()
    folder = tmp_path_factory.mktemp("deepseek")
    hf.save_pretrained(folder)
    config = ModelConfig.from_hf_folder(folder)
    with torch.device("meta"):
        ours = DeepseekForCausalLM(config)
    load_weights(ours, folder, torch.float32, "cpu")
    return hf, folder, ours


def _tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_matches_hf(pair):
    hf, _, ours = pair
    tokens = _tokens(19, seed=0)
    logits = PagedRunner(ours).step({0: tokens})[0]
    assert rel_err(logits, hf_logits(hf, tokens)) < TOL


def test_chunked_prefill_then_32_greedy_decode_steps_match_hf(pair):
    hf, _, ours = pair
    prompt = _tokens(11, seed=1)
    runner = PagedRunner(ours, num_blocks=64)
    chunks = [runner.step({0: prompt[:6]})[0], runner.step({0: prompt[6:]})[0]]
    tokens = list(prompt)
    decoded = []
    for _ in range(32):
        tokens.append(int(chunks[-1][-1].argmax()) if not decoded else int(decoded[-1].argmax()))
        decoded.append(runner.step({0: tokens[-1:]})[0][0])
    ref = hf_logits(hf, tokens)
    assert rel_err(torch.cat(chunks), ref[:11]) < TOL
    for step, logits in enumerate(decoded):
        assert rel_err(logits, ref[11 + step]) < TOL, step


def test_batched_decodes_beside_a_chunk_match_hf(pair):
    hf, _, ours = pair
    a, b, c = _tokens(14, seed=2), _tokens(7, seed=3), _tokens(9, seed=4)
    refs = [hf_logits(hf, t) for t in (a, b, c)]
    runner = PagedRunner(ours)
    steps = [
        {0: (0, 10), 1: (0, 5), 2: (0, 8)},
        {0: (10, 13), 1: (5, 6), 2: (8, 9)},  # a chunk beside two decode tokens
        {0: (13, 14), 1: (6, 7)},
    ]
    for step in steps:
        out = runner.step({seq: (a, b, c)[seq][s:e] for seq, (s, e) in step.items()})
        for seq, (s, e) in step.items():
            assert rel_err(out[seq], refs[seq][s:e]) < TOL, (seq, s, e)


def _hf_greedy(hf, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_engine_batches_chunks_and_frees_every_block(pair):
    hf, folder, _ = pair
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        block_size=4,
        kv_cache_gb=1e-4,
        max_num_seqs=4,
        max_num_batched_tokens=8,  # the 13-token prompt is prefilled in chunks
    )
    engine = LLMEngine.build(config)
    assert engine.kv_cache.storage.shape[1:] == (1, engine.kv_cache.num_blocks + 1, 1, 4, 40)
    prompts = [_tokens(5, seed=5), _tokens(13, seed=6), _tokens(9, seed=7)]
    stop = StopConditions(max_tokens=8, ignore_eos=True)
    outputs = engine.generate(prompts, SamplingParams(), stop)
    assert outputs == [_hf_greedy(hf, p, 8) for p in prompts]
    assert engine.pool.num_free == engine.pool.num_total
    assert not engine.has_unfinished


def test_random_preset_generates_and_frees_every_block():
    engine = LLMEngine.build(
        EngineConfig(model="random:deepseek-tiny", dtype="float32", block_size=4, kv_cache_gb=1e-3)
    )
    outputs = engine.generate(
        [[1, 5, 9], [1, 7, 3, 8, 200]],
        SamplingParams(),
        StopConditions(max_tokens=4, ignore_eos=True),
    )
    assert [len(out) for out in outputs] == [4, 4]
    assert engine.pool.num_free == engine.pool.num_total
    bias = engine.runner.model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32


def test_bf16_keeps_the_router_in_float32(pair):
    """The router's weight (and V3's correction bias) stay float32 in a bf16 model."""
    _, folder, _ = pair
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_hf_folder(folder))
    load_weights(model, folder, torch.bfloat16, "cpu")
    gate = model.model.layers[2].mlp.gate
    assert gate.weight.dtype == torch.float32
    routed_by_bias = gate.moe.topk_method == "noaux_tc"
    assert (gate.e_score_correction_bias is not None) == routed_by_bias
    if routed_by_bias:
        assert gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[2].mlp.experts.gate_up_proj.dtype == torch.bfloat16
