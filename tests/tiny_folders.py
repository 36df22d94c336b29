"""Tiny random models with SmolLM2's tokenizer and vocabulary, as Hugging Face folders, for the
suites that serve them through the router (which tokenizes with the folder's tokenizer):
- `write_tiny_kv4`: a Llama of 8 attention heads and 4 KV heads (head_dim 32, which vLLM's CPU
  attention takes), what the tensor-parallel suites split over 2 and 4 ranks (engine preset
  `tiny-kv4` is its shape);
- `write_tiny_mla`: a DeepSeek-V3 (MLA + MoE: a dense first layer, 8 routed experts and a
  shared one, a q bottleneck), whose 4 heads and expert channels split over 2 ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from tests.servers import MODEL

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32,
             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
MLA = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
           first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=2048,
           tie_word_embeddings=False)  # fmt: skip


def write_tiny_kv4(out: Path, num_kv_heads: int = 4) -> Path:
    """The Llama folder (with `num_kv_heads` KV heads), in `out`; weights: transformers' random
    initialization (seed 0)."""
    config = {**_smollm2_config(), **SHAPE, "num_key_value_heads": num_kv_heads}
    return _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)), out)


def write_tiny_mla(out: Path) -> Path:
    """The DeepSeek-V3 folder, in `out`; weights: transformers' random initialization."""
    smollm2 = _smollm2_config()
    config = transformers.DeepseekV3Config(
        **MLA, vocab_size=smollm2["vocab_size"], bos_token_id=smollm2["bos_token_id"],
        eos_token_id=smollm2["eos_token_id"],
    )  # fmt: skip
    return _save(transformers.DeepseekV3ForCausalLM(config), out)


def _smollm2_config() -> dict:
    return json.loads((Path(MODEL) / "config.json").read_text())


def _save(model: transformers.PreTrainedModel, out: Path) -> Path:
    torch.manual_seed(0)
    model.init_weights()  # seeded: the same weights in every suite
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(MODEL) / name, out / name)
    return out
