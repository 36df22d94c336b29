"""MLA's two attention forms, MoE routing against transformers, DeepSeek configs and caches."""

import dataclasses
import json

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from engine.config import ModelConfig
from engine.deepseek import DeepseekForCausalLM
from engine.deepseek_config import MoeConfig
from engine.kv_cache import KVCache
from engine.mla import attend_absorbed, attend_expanded, gather_latents, write_latent
from engine.moe import route
from engine.tests.tiny_hf import MLA_MOE, PagedRunner, randomize, rel_err
from engine.weights import load_weights

HEADS, NOPE, ROPE, RANK, V = 4, 16, 8, 32, 12


def test_absorbed_decode_equals_expanded_attention():
    gen = torch.Generator().manual_seed(0)
    lens = [1, 7, 13]
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=gen)
    cache = torch.randn(10, 1, 4, RANK + ROPE, generator=gen)
    tables = torch.tensor([[3, 0, 0, 0], [5, 1, 0, 0], [9, 2, 7, 4]], dtype=torch.int32)
    q_nope = torch.randn(3, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(3, HEADS, ROPE, generator=gen)
    cache[0, 0, 1:] = float("nan")  # past sequence 0's end: must not leak into its output
    contexts = gather_latents(cache, tables, cache.dtype)
    absorbed = attend_absorbed(q_nope, q_pe, contexts, torch.tensor(lens), kv_b, 0.2)
    for i, n in enumerate(lens):  # each row is the last token of its context
        expanded = attend_expanded(q_nope[i : i + 1], q_pe[i : i + 1], contexts[i, :n], kv_b, 0.2)
        assert absorbed.shape == (3, HEADS, V)
        torch.testing.assert_close(absorbed[i], expanded[0], rtol=1e-5, atol=1e-5)


def test_write_latent_puts_rows_at_their_slots():
    cache = torch.zeros(4, 1, 2, 3)
    write_latent(cache, torch.tensor([[1.0, 2, 3], [4, 5, 6]]), torch.tensor([5, 0]))
    assert cache[2, 0, 1].tolist() == [1, 2, 3] and cache[0, 0, 0].tolist() == [4, 5, 6]
    assert cache.count_nonzero() == 6


def _moe(topk_method: str, scoring_func: str, norm: bool) -> MoeConfig:
    return MoeConfig(
        n_routed_experts=16,
        num_experts_per_tok=3,
        moe_intermediate_size=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        topk_method=topk_method,
        scoring_func=scoring_func,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        first_k_dense_replace=0,
    )


def _sorted(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
def test_noaux_tc_routing_equals_transformers(norm):
    moe = _moe("noaux_tc", "sigmoid", norm)
    hf_config = transformers.DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_()
        # Large enough to change which groups and experts win.
        router.e_score_correction_bias.normal_(0.0, 0.5)
    h = torch.randn(64, 32)
    _, hf_weights, hf_ids = router(h)
    logits = torch.nn.functional.linear(h, router.weight)
    weights, ids = route(logits, router.e_score_correction_bias, moe)
    unbiased = route(logits, None, moe)[1]
    assert not torch.equal(ids.sort().values, unbiased.sort().values)  # the bias mattered
    hf_weights, hf_ids = _sorted(hf_weights, hf_ids)
    weights, ids = _sorted(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_softmax_routing_equals_transformers_deepseek_v2(topk_method):
    moe = _moe(topk_method, "softmax", norm=False)  # transformers' V2 does not renormalize
    hf_config = transformers.DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method=topk_method,
        routed_scaling_factor=2.5,
    )
    torch.manual_seed(1)
    router = DeepseekV2TopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_()
    h = torch.randn(64, 32)
    _, hf_weights, hf_ids = router(h)
    weights, ids = route(torch.nn.functional.linear(h, router.weight), None, moe)
    weights, ids = _sorted(weights, ids)
    hf_weights, hf_ids = _sorted(hf_weights, hf_ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


def test_glm4_moe_lite_loads_and_matches_transformers(tmp_path):
    config = transformers.Glm4MoeLiteConfig(
        **MLA_MOE, q_lora_rank=None, mlp_layer_types=["dense", "sparse", "sparse"]
    )
    torch.manual_seed(0)
    hf = randomize(transformers.Glm4MoeLiteForCausalLM(config).eval())
    hf.save_pretrained(tmp_path)
    ours_config = ModelConfig.from_hf_folder(tmp_path)
    assert ours_config.moe.first_k_dense_replace == 1 and ours_config.mla.q_lora_rank is None
    with torch.device("meta"):
        ours = DeepseekForCausalLM(ours_config)
    load_weights(ours, tmp_path, torch.float32, "cpu")
    tokens = list(range(3, 20))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens])).logits[0]
    assert rel_err(PagedRunner(ours).step({0: tokens})[0], ref) < 1e-4


def test_latent_cache_has_one_plane_per_layer():
    config = ModelConfig.preset("deepseek-tiny")
    assert config.kv_format == "mla-latent"
    assert config.kv_bytes_per_token(torch.bfloat16) == 3 * (32 + 8) * 2
    cache = KVCache(config, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert [len(planes) for planes in cache.kv_caches] == [1, 1, 1]
    assert cache.kv_caches[0][0].shape == (6, 1, 4, 40)
    cache.kv_caches[1][0][2] = 1.0
    cache.copy_blocks([2], [4])
    assert bool((cache.kv_caches[1][0][4] == 1.0).all())
    llama = ModelConfig.preset("tiny")
    assert llama.kv_format == "hnd" and llama.kv_planes == (2, 2, 16)


V2 = "DeepseekV2ForCausalLM"


def _hf_dict(**overrides):
    d = dict(
        architectures=["DeepseekV3ForCausalLM"],
        **MLA_MOE,
        n_group=2,
        topk_group=1,
        q_lora_rank=48,
        rms_norm_eps=1e-6,
    )
    return json.loads(json.dumps({**d, **overrides}))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(topk_method="greedy"), "topk_method"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(rope_scaling={"type": "llama3", "factor": 8.0}), "rope_type 'llama3'"),
        (dict(n_group=3), "n_group"),
        (dict(topk_group=3), "topk_group"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(architectures=[V2], topk_method="noaux_tc"), "topk_method 'noaux_tc'.*greedy"),
        (dict(architectures=[V2], scoring_func="sigmoid"), "scoring_func"),
        (dict(architectures=[V2], norm_topk_prob=True), "norm_topk_prob"),
    ],
)
def test_deepseek_configs_are_refused_by_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(_hf_dict(**overrides))


def test_deepseek_v2_lite_config_parses():
    """DeepSeek-V2-Lite's own config.json routing: softmax, greedy top-6 of 64, unscaled; a V2
    config without them (transformers writes no scoring_func) routes the same."""
    routing = dict(topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, n_group=1)
    for fields in (routing, {}):
        d = {**_hf_dict(architectures=[V2], topk_group=1, n_group=1), **fields}
        moe = ModelConfig.from_hf_dict(d).moe
        assert (moe.topk_method, moe.scoring_func, moe.norm_topk_prob) == (
            "greedy",
            "softmax",
            False,
        )


def test_deepseek_v3_config_with_original_spelling_parses():
    rope = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32)
    config = ModelConfig.from_hf_dict(
        _hf_dict(rope_scaling=rope, topk_method="noaux_tc", scoring_func="sigmoid")
    )
    assert config.rope_scaling.factor == 40 and config.rope_scaling.beta_slow == 1.0
    assert config.num_kv_heads == 4 and config.head_dim == 8
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict(
            {**_hf_dict(), "architectures": ["LlamaForCausalLM"]} | {"rope_scaling": rope}
        )
    with pytest.raises(ValueError, match="mla and moe"):
        dataclasses.replace(config, mla=None)
