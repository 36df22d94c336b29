import dataclasses
import json

import pytest
import torch

from engine.config import Llama3RopeScaling, ModelConfig

# config.json of meta-llama/Llama-3.1-8B-Instruct (transformers 4.x spelling).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# config.json of Qwen/Qwen3-8B; its generation_config.json adds eos 151643.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# config.json of HuggingFaceTB/SmolLM2-135M-Instruct (no head_dim: it is implied).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49152,
}

# config.json of Qwen/Qwen2.5-0.5B-Instruct: a sliding_window value that is switched off.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# config.json of mistralai/Mistral-7B-Instruct-v0.3.
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": None,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32768,
}


def test_real_configs_parse_to_the_presets(tmp_path):
    assert ModelConfig.from_hf_dict(LLAMA31_8B) == ModelConfig.preset("llama3-8b")
    assert ModelConfig.from_hf_dict(SMOLLM2_135M) == ModelConfig.preset("smollm2-135m")
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643]})
    )
    assert ModelConfig.from_hf_folder(tmp_path) == ModelConfig.preset("qwen3-8b")


def test_folder_without_generation_config_uses_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    assert ModelConfig.from_hf_folder(tmp_path).eos_token_ids == (151645,)


def test_qwen2_has_qkv_bias_and_mistral_implies_head_dim():
    qwen2 = ModelConfig.from_hf_dict(QWEN25_05B)
    assert (qwen2.attention_bias, qwen2.qk_norm, qwen2.head_dim) == (True, False, 64)
    mistral = ModelConfig.from_hf_dict(MISTRAL_7B)
    assert (mistral.head_dim, mistral.attention_bias, mistral.rope_scaling) == (128, False, None)
    assert ModelConfig.from_hf_dict(QWEN3_8B).qk_norm


def test_transformers5_rope_parameters_spelling():
    d = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf_dict(d) == ModelConfig.preset("llama3-8b")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    parsed = ModelConfig.from_hf_dict(d)
    assert (parsed.rope_theta, parsed.rope_scaling) == (1234.0, None)


def test_presets():
    tiny = ModelConfig.preset("tiny")
    assert tiny.num_kv_heads < tiny.num_heads and tiny.num_layers <= 4
    smol = ModelConfig.preset("smollm2-135m")
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads) == (30, 576, 9, 3)
    assert (smol.head_dim, smol.intermediate_size, smol.vocab_size) == (64, 1536, 49152)
    assert smol.rope_theta == 100000.0 and smol.tie_word_embeddings
    # 2 (K, V) * 32 layers * 8 heads * 128 dims * 2 bytes
    assert ModelConfig.preset("llama3-8b").kv_bytes_per_token(torch.bfloat16) == 131072
    assert smol.kv_bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    with pytest.raises(ValueError, match=r"unknown preset 'gpt2'.*tiny"):
        ModelConfig.preset("gpt2")


def _with(base, **changes):
    return {**base, **changes}


@pytest.mark.parametrize(
    "config,match",
    [
        (
            _with(LLAMA31_8B, architectures=["GPT2LMHeadModel"]),
            r"'GPT2LMHeadModel' is not supported \(supported: LlamaForCausalLM, Mistral",
        ),
        (_with(LLAMA31_8B, architectures=None), "architectures"),
        (
            _with(LLAMA31_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            r"rope_scaling: rope_type 'yarn' is not supported",
        ),
        (_with(LLAMA31_8B, rope_scaling={"type": "linear", "factor": 2.0}), "'linear'"),
        (
            _with(LLAMA31_8B, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "low_freq_factor, high_freq_factor, original_max_position_embeddings",
        ),
        (_with(MISTRAL_7B, sliding_window=4096), "sliding_window=4096"),
        (_with(QWEN25_05B, use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        (_with(LLAMA31_8B, hidden_act="gelu"), "hidden_act 'gelu'"),
        (_with(LLAMA31_8B, mlp_bias=True), "mlp_bias"),
        (_with(LLAMA31_8B, attention_bias=True), "attention_bias"),
        (_with(LLAMA31_8B, hidden_size=None), "hidden_size"),
        (_with(LLAMA31_8B, num_key_value_heads=5), r"num_kv_heads \(5\) must divide"),
        (_with(LLAMA31_8B, vocab_size=0), "vocab_size"),
        (_with(LLAMA31_8B, eos_token_id=[128001, 200000]), "eos_token_ids: 200000"),
        (_with(LLAMA31_8B, bos_token_id=-1), "bos_token_id"),
        (_with(LLAMA31_8B, rms_norm_eps=0.0), "rms_norm_eps"),
        (_with(LLAMA31_8B, head_dim=63), "head_dim"),
    ],
)
def test_rejections_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(config)


def test_direct_construction_is_validated():
    tiny = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(tiny, num_layers=0)
    with pytest.raises(ValueError, match="eos_token_ids must be a tuple"):
        dataclasses.replace(tiny, eos_token_ids=[2])
    with pytest.raises(ValueError, match="architecture 'Foo'"):
        dataclasses.replace(tiny, architecture="Foo")
    with pytest.raises(ValueError, match="rope_theta"):
        dataclasses.replace(tiny, rope_theta=0.0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=4.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
    with pytest.raises(ValueError, match=r"rope_scaling\.factor"):
        Llama3RopeScaling(
            factor=0.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
