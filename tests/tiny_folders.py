"""Tiny random models with SmolLM2's tokenizer and vocabulary, as Hugging Face folders, for the
suites that serve them through the router (which tokenizes with the folder's tokenizer):
- `write_tiny_kv4`: a Llama of 8 attention heads and 4 KV heads (head_dim 32, which vLLM's CPU
  attention takes), what the tensor-parallel suites split over 2 and 4 ranks (engine preset
  `tiny-kv4` is its shape);
- `write_tiny_mla`: a DeepSeek-V3 (MLA + MoE: a dense first layer, 8 routed experts and a
  shared one, a q bottleneck), whose 4 heads and expert channels split over 2 ranks; with an
  MTP layer for the speculative suites;
- `write_vllm_mla`: a DeepSeek-V3 that stock vLLM's CPU build serves (a 512 + 64 latent);
- `write_eagle3`: a Llama of eight layers (head_dim 64, which vLLM's CPU attention takes) and
  an EAGLE-3 head for it, drafting from 2,000 of the vocabulary's tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from engine.tests.tiny_hf import MLA_MOE, add_mtp_layer, randomize, write_eagle3_head
from tests.servers import MODEL

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32,
             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
MLA = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
           first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=2048,
           tie_word_embeddings=False)  # fmt: skip
# What vLLM's CPU build serves: its CPU_MLA backend reads only DeepSeek-V3's latent (512 + 64),
# it loads the router's correction bias only for noaux_tc, and its CPU rotary kernel is right
# for MLA's q_pe and k_pe views only through YaRN's torch code (tests/vllm_mla_test.py).
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
            mscale_all_dim=1.0)  # fmt: skip
VLLM_MLA = dict(
    MLA_MOE,
    vocab_size=49152,  # SmolLM2's tokenizer
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    q_lora_rank=48,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    max_position_embeddings=1024,
    rope_parameters=YARN,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tiny_kv4(out: Path, num_kv_heads: int = 4) -> Path:
    """The Llama folder (with `num_kv_heads` KV heads), in `out`; weights: transformers' random
    initialization (seed 0)."""
    config = {**_smollm2_config(), **SHAPE, "num_key_value_heads": num_kv_heads}
    return _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)), out)


def write_tiny_mla(out: Path, mtp: bool = False) -> Path:
    """The DeepSeek-V3 folder, in `out`; weights: transformers' random initialization. `mtp`:
    with one multi-token-prediction layer (random, seeded) as DeepSeek-V3 checkpoints carry."""
    smollm2 = _smollm2_config()
    config = transformers.DeepseekV3Config(
        **MLA, vocab_size=smollm2["vocab_size"], bos_token_id=smollm2["bos_token_id"],
        eos_token_id=smollm2["eos_token_id"],
    )  # fmt: skip
    _save(transformers.DeepseekV3ForCausalLM(config), out)
    if mtp:
        add_mtp_layer(out)
    return out


def write_vllm_mla(out: Path, mtp: bool = False) -> Path:
    """A DeepSeek-V3 that vLLM's CPU build serves (VLLM_MLA), in `out`; weights: random, seeded;
    `mtp`: with one multi-token-prediction layer."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**VLLM_MLA))
    randomize(hf.eval()).save_pretrained(out)
    _copy_tokenizer(out)
    if mtp:
        add_mtp_layer(out)
    return out


EAGLE3_TARGET = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=8, head_dim=64,
                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                     max_position_embeddings=2048)  # fmt: skip


def write_eagle3(out: Path) -> tuple[Path, Path]:
    """(the target's folder, the head's), under `out`; random weights, seeded."""
    smollm2 = _smollm2_config()
    config = {**smollm2, **EAGLE3_TARGET}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    target = out / "target"
    randomize(model.eval()).save_pretrained(target)
    _copy_tokenizer(target)
    saved = json.loads((target / "config.json").read_text())  # RoPE as transformers wrote it
    head = {key: saved[key] for key in ("hidden_size", "intermediate_size", "head_dim",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "rope_parameters")}  # fmt: skip
    head |= dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                 num_hidden_layers=1, draft_vocab_size=2000)  # fmt: skip
    write_eagle3_head(out / "head", head)
    return target, out / "head"


def _smollm2_config() -> dict:
    return json.loads((Path(MODEL) / "config.json").read_text())


def _save(model: transformers.PreTrainedModel, out: Path) -> Path:
    torch.manual_seed(0)
    model.init_weights()  # seeded: the same weights in every suite
    model.save_pretrained(out)
    _copy_tokenizer(out)
    return out


def _copy_tokenizer(out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(MODEL) / name, out / name)
