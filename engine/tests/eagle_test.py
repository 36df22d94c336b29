"""EAGLE-3 heads (engine/eagle.py) on a tiny random six-layer Llama target, float32, CPU:
- the streams the target keeps for the head (its config names layers 1, 3 and 4) are
  transformers' hidden states entering those layers;
- the head's three chained drafts after a prompt equal a reference computed here from the
  checkpoint's tensors with transformers' Llama RoPE and torch's attention, as vLLM's EAGLE-3
  computes them (the draft vocabulary mapped through d2t);
- greedy output with the head equals output without, batched, chunked; the pool all free;
- refusals naming the fix: an MLA target, a head of another width, a trainer's variant, target
  layers the target does not have, a folder that is not an EAGLE-3 head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.eagle import Eagle3Config
from engine.llm_engine import EngineConfig, LLMEngine
from engine.presets import PRESETS
from engine.sampling import SamplingParams
from engine.sequence import StopConditions
from engine.speculative import SpeculativeConfig
from engine.tests.tiny_hf import _COMMON, randomize, write_eagle3_head

LAYERS = 6
AUX = [1, 3, 4]
DRAFT_VOCAB = 60
ROPE = dict(rope_theta=10000.0)
HEAD = dict(
    architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=64,
    intermediate_size=112,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
    vocab_size=_COMMON["vocab_size"], draft_vocab_size=DRAFT_VOCAB, rms_norm_eps=1e-5,
    max_position_embeddings=128, tie_word_embeddings=False, **ROPE,
    eagle_config={"eagle_aux_hidden_state_layer_ids": AUX},
)  # fmt: skip
PROMPTS = [[1, 17, 42, 9, 33, 7, 81, 5, 60, 12, 3, 44, 70, 21, 8, 90, 31, 2, 55, 64], [5, 6, 7]]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, transformers.LlamaForCausalLM]:
    config = transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": LAYERS}, **ROPE)
    torch.manual_seed(0)
    model = randomize(transformers.LlamaForCausalLM(config).eval())
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("eagle3")
    return folder, write_eagle3_head(folder, HEAD)


def _engine(target: Path, head: Path | None, **overrides) -> LLMEngine:
    spec = None if head is None else SpeculativeConfig("eagle3", 3, model=str(head))
    config = dict(model=str(target), dtype="float32", block_size=16, kv_cache_gb=0.01,
                  max_num_seqs=4, speculative_config=spec)  # fmt: skip
    return LLMEngine.build(EngineConfig(**{**config, **overrides}))


def test_the_heads_drafts_equal_a_reference_of_its_checkpoint(target, head):
    folder, hf = target
    engine = _engine(folder, head[0])
    prompt = PROMPTS[0]
    seq = engine.add_request("r", prompt, SamplingParams(), StopConditions(8, ignore_eos=True))
    engine.step()  # the prompt: its first token, and the target's streams kept for the head
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    first = int(out.logits[0, -1].argmax())
    assert seq.token_ids[-1] == first
    aux = torch.cat([out.hidden_states[i][0] for i in AUX], dim=-1)  # entering those layers
    assert torch.allclose(engine.runner.model.model.aux, aux, atol=1e-5)
    drafts = engine.proposer.propose([seq], [3])[0]
    assert drafts == _reference_drafts(hf, head[1], [*prompt[1:], first], aux, 3)


def _reference_drafts(hf, w: dict, tokens: list[int], aux: torch.Tensor, k: int) -> list[int]:
    """vLLM's EAGLE-3 step, written out: positions 0 .. n - 1 take token j + 1 and fc(aux_j),
    each further draft its predecessor's token and output stream, one causal pass each."""
    drafts, previous = [], aux @ w["fc.weight"].T
    for _ in range(k):
        g, logits = _head_rows(hf, w, tokens, previous)
        draft = int(logits[-1].argmax()) + int(w["d2t"][int(logits[-1].argmax())])
        drafts.append(draft)
        tokens, previous = [*tokens, draft], torch.cat([previous, g[-1:]])
    return drafts


def _head_rows(hf, w, tokens, previous):
    def rms(x, name):
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    n = len(tokens)
    embedded = hf.model.embed_tokens(torch.tensor(tokens))
    h = torch.cat([rms(embedded, "midlayer.input_layernorm.weight"),
                   rms(previous, "midlayer.hidden_norm.weight")], dim=-1)  # fmt: skip
    q = (h @ w["midlayer.self_attn.q_proj.weight"].T).view(1, n, 4, 16).transpose(1, 2)
    key = (h @ w["midlayer.self_attn.k_proj.weight"].T).view(1, n, 2, 16).transpose(1, 2)
    v = (h @ w["midlayer.self_attn.v_proj.weight"].T).view(1, n, 2, 16).transpose(1, 2)
    rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(**{**_COMMON, **ROPE}))
    cos, sin = rotary(v, torch.arange(n)[None])
    q, key = apply_rotary_pos_emb(q, key, cos, sin)
    key, v = key.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    attended = F.scaled_dot_product_attention(q, key, v, is_causal=True)
    x = previous + attended.transpose(1, 2).reshape(n, 64) @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(x, "midlayer.post_attention_layernorm.weight")
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    x = x + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return x, rms(x, "norm.weight") @ w["lm_head.weight"].T


def test_greedy_output_with_the_head_equals_without(target, head):
    """Batched, the long prompt prefilled in chunks of 8: every token the target's."""
    stop = StopConditions(16, ignore_eos=True)
    plain = _engine(target[0], None).generate(PROMPTS, SamplingParams(), stop)
    engine = _engine(target[0], head[0], max_num_batched_tokens=8)
    assert engine.generate(PROMPTS, SamplingParams(), stop) == plain
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.pool.num_free == engine.pool.num_total


def test_a_random_head_of_a_preset_changes_no_token():
    """random:eagle3-tiny on random:tiny-8l (the streams entering layers 2, 4 and 5), drafting
    from 200 of its 256 tokens."""
    base = dict(model="random:tiny-8l", dtype="float32", kv_cache_gb=0.01, max_num_seqs=4)
    spec = SpeculativeConfig("eagle3", 2, model="random:eagle3-tiny")
    stop = StopConditions(12, ignore_eos=True)
    plain = LLMEngine.build(EngineConfig(**base)).generate(PROMPTS, SamplingParams(), stop)
    engine = LLMEngine.build(EngineConfig(**base, speculative_config=spec))
    assert engine.runner.model.model.aux_layers == (2, 4, 5)
    assert len(set(engine.proposer.layers[0].draft_to_target.tolist())) == 200
    assert engine.generate(PROMPTS, SamplingParams(), stop) == plain
    assert engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 48}, "hidden_size 48 is not the target's 64"),
        ({"norm_before_residual": True}, "norm_before_residual=true is not supported"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 6]}}, "not distinct layers"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 3]}}, "of the target's 6"),
        ({"architectures": ["LlamaForCausalLM"]}, "is not an EAGLE-3 head"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_naming_why(target, tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**HEAD, **change}))
    with pytest.raises(ValueError, match=message):
        _engine(target[0], tmp_path)


def test_an_mla_target_is_refused():
    with pytest.raises(ValueError, match="MLA family"):
        Eagle3Config.load("random:eagle3-smollm2").target_layers(PRESETS["deepseek-tiny"])
