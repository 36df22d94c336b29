"""A tiny random Llama with SmolLM2's tokenizer and vocabulary, 8 attention heads and 4 KV heads
(head_dim 32, which vLLM's CPU attention takes), as a Hugging Face folder: what the
tensor-parallel suites split over 2 ranks (engine preset `tiny-kv4` is its shape)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from tests.servers import MODEL

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32,
             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip


def write_tiny_kv4(out: Path) -> Path:
    """The folder, in `out`; its weights are transformers' random initialization (seed 0)."""
    config = {**json.loads((Path(MODEL) / "config.json").read_text()), **SHAPE}
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(MODEL) / name, out / name)
    return out
