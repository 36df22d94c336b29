import dataclasses
import itertools

import pytest
import torch

from engine.config import ModelConfig
from engine.model import CausalLM, rope_inv_freq
from engine.tests.tiny_hf import KINDS, VOCAB, PagedRunner, hf_logits, hf_model, load, rel_err

TOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """(Hugging Face model, our model loaded from its save_pretrained folder)."""
    torch.set_num_threads(1)
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, load(folder)


def _tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prompt_forward_matches_hf(pair):
    hf, ours = pair
    tokens = _tokens(15, seed=0)
    logits = PagedRunner(ours).step({0: tokens})[0]
    assert logits.dtype == torch.float32 and logits.shape == (15, VOCAB)
    assert rel_err(logits, hf_logits(hf, tokens)) < TOL


def test_chunked_prefill_then_decode_matches_hf(pair):
    hf, ours = pair
    tokens = _tokens(17, seed=1)  # an 11-token prompt, then 6 decode steps
    ref = hf_logits(hf, tokens)
    runner = PagedRunner(ours)
    for start, end in [(0, 6), (6, 11)] + [(t, t + 1) for t in range(11, 17)]:
        logits = runner.step({0: tokens[start:end]})[0]
        assert rel_err(logits, ref[start:end]) < TOL, (start, end)
    table = runner.tables[0]
    assert len(table) == 5  # 17 tokens in blocks of 4
    assert any(b != a + 1 for a, b in itertools.pairwise(table))  # the context really is scattered


def test_batched_sequences_of_different_lengths_match_hf(pair):
    hf, ours = pair
    a, b = _tokens(15, seed=2), _tokens(8, seed=3)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    runner = PagedRunner(ours)
    steps = [
        {0: (0, 9), 1: (0, 6)},  # two prompts of different lengths
        {0: (9, 13), 1: (6, 7)},  # a prompt chunk beside a decode token
        {0: (13, 14), 1: (7, 8)},  # two decode tokens
        {0: (14, 15)},
    ]
    for step in steps:
        out = runner.step({seq: (a, b)[seq][s:e] for seq, (s, e) in step.items()})
        for seq, (s, e) in step.items():
            assert rel_err(out[seq], (ref_a, ref_b)[seq][s:e]) < TOL, (seq, s, e)


def test_model_builds_on_meta_with_hf_names_and_fused_projections():
    config = ModelConfig.preset("tiny")
    with torch.device("meta"):
        model = CausalLM(dataclasses.replace(config, qk_norm=True))
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    layer = "model.layers.1."
    assert params[layer + "self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)
    assert params[layer + "mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    assert layer + "self_attn.q_norm.weight" in params
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= params.keys()
    assert not any(name.endswith("inv_freq") for name in model.state_dict())


def test_tied_model_has_no_lm_head_and_uses_the_embedding():
    config = ModelConfig.preset("smollm2-135m")
    with torch.device("meta"):
        model = CausalLM(config)
    assert model.lm_head is None
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_llama3_rope_scaling_changes_only_low_frequencies():
    config = ModelConfig.preset("llama3-8b")
    plain = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    scaled = rope_inv_freq(config)
    wavelen = 2 * torch.pi / plain
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    middle = ~high & ~low
    assert middle.any()
    assert bool(((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_gives_the_computed_angles_bit_for_bit(dtype):
    config = ModelConfig.preset("llama3-8b")
    with torch.device("meta"):
        model = CausalLM(config)
    model.model.rotary_emb.to_empty(device="cpu")
    model.init_buffers()
    rotary = model.model.rotary_emb
    positions = torch.tensor([0, 1, 7, 1023, 8191, 20000, 3])
    computed = rotary(positions, dtype)
    rotary.cache(20001, dtype)
    assert rotary.table.shape == (2, 20001, config.head_dim // 2)
    tabulated = rotary(positions, dtype)
    for got, want in zip(tabulated, computed, strict=True):
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got, want)
    assert torch.equal(
        rotary(positions, torch.float16)[0], rotary._compute(positions, torch.float16)[0]
    )
    model.init_buffers()  # new frequencies: the table of the old ones goes
    assert rotary.table is None
