"""Builders shared by the model and weights tests: tiny Hugging Face models and a paged runner."""

import dataclasses
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.mtp import MtpLayer
from engine.weights import hf_state_dict, init_random_weights, load_weights

VOCAB = 96

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# The DeepSeek-V3 family's (MLA and MoE) shared by its tests: three layers, 8 routed experts
# of 32 channels, a 32-channel latent with 8 RoPE channels.
MLA_MOE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    max_position_embeddings=128,
)

# Llama with Llama-3 RoPE scaling whose original context (32) is short enough that the scaled,
# interpolated and untouched frequency bands all occur at head_dim 16.
_KINDS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=None, rope_theta=1000.0),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=5000.0)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=20000.0)),
}
KINDS = tuple(_KINDS)


def hf_model(kind: str, tie: bool = False, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random model of `kind`, every parameter (biases, norms) random and non-trivial."""
    config_cls, model_cls, extra = _KINDS[kind]
    torch.manual_seed(seed)
    return randomize(model_cls(config_cls(**_COMMON, **extra, tie_word_embeddings=tie)).eval())


def randomize(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Every parameter random and non-trivial (norm weights around 1, the rest small), and so
    a DeepSeek router's correction bias: initial values (ones, zeros) would hide mistakes."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


# YaRN with an original context (32) short enough that the scaled, ramped and untouched bands
# all occur at rope dim 8; mscale_all_dim scales the softmax too.
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    beta_fast=8.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=1.0,
)


def hf_deepseek(q_lora_rank: int | None, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random DeepSeek-V3: a dense first layer, then 8 routed experts (top-2 of the best
    group of 2) and a shared one, every parameter and the correction bias non-trivial."""
    config = transformers.DeepseekV3Config(
        **MLA_MOE,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=q_lora_rank,
        rope_parameters=YARN,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return randomize(transformers.DeepseekV3ForCausalLM(config).eval())


def hf_deepseek_v2(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random DeepSeek-V2: softmax scores, the 2 best experts within the best of 2 groups
    (group_limited_greedy), scaled by 2.5 and not renormalized; RoPE on interleaved pairs as
    complex numbers; no q bottleneck (DeepSeek-V2-Lite's)."""
    config = transformers.DeepseekV2Config(
        **MLA_MOE,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=None,
        rope_parameters=YARN,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return randomize(transformers.DeepseekV2ForCausalLM(config).eval())


def add_mtp_layer(folder: Path, seed: int = 5) -> MtpLayer:
    """Adds one random multi-token-prediction layer to a DeepSeek-V3 folder, as DeepSeek-V3's
    checkpoints carry it: its tensors under model.layers.<num_layers>. (with their identical
    copy of the embedding) and num_nextn_predict_layers 1 in config.json. Returns the layer,
    float32, whose parameters were written."""
    config_path = folder / "config.json"
    hf_config = json.loads(config_path.read_text())
    config = ModelConfig.from_hf_dict(hf_config)
    with torch.device("meta"):
        layer = MtpLayer(dataclasses.replace(config, num_mtp_layers=1), 0)
    init_random_weights(layer, seed=seed, dtype=torch.float32, device="cpu")
    prefix = f"model.layers.{config.num_layers}."
    tensors = load_file(folder / "model.safetensors")
    tensors |= {prefix + name: t.contiguous() for name, t in hf_state_dict(layer).items()}
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config_path.write_text(json.dumps({**hf_config, "num_nextn_predict_layers": 1}))
    return layer


def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def load(folder: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    config = ModelConfig.from_hf_folder(folder)
    with torch.device("meta"):
        model = CausalLM(config)
    load_weights(model, folder, dtype, "cpu")
    return model


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


class PagedRunner:
    """Steps sequences through a model and a KV cache whose block ids are handed out scattered,
    so every context spans non-adjacent blocks."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int = 48,
        block_size: int = 4,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        dtype = kv_dtype or model.model.embed_tokens.weight.dtype
        self.cache = KVCache(model.config, num_blocks, block_size, dtype, "cpu")
        self.block_size = block_size
        gen = torch.Generator().manual_seed(1234)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Runs one forward over {seq: new tokens}; returns {seq: logits [n, vocab]}."""
        ids, positions, seq_lens, tables = [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.lens[seq] = end
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            tables.append(table)
        meta = AttentionMetadata.build(
            [len(t) for t in chunks.values()], seq_lens, tables, self.block_size
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.cache.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split([len(t) for t in chunks.values()]), strict=True))


def write_eagle3_head(folder: Path, config: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head folder as trainers write it, for `config` (its config.json): `midlayer.`
    q/k/v/o, gate/up/down and three norms, fc (of three aux streams, or as many as its
    eagle_aux_hidden_state_layer_ids), norm, lm_head over draft_vocab_size tokens, d2t and t2d
    of a random draft vocabulary; every tensor random and non-trivial. Returns the tensors."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    vocab, draft = config["vocab_size"], config["draft_vocab_size"]
    aux = len(config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or [0] * 3)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * 0.1

    def norm() -> torch.Tensor:
        return torch.rand(hidden, generator=generator) + 0.5

    kept = torch.randperm(vocab, generator=generator)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    layer = "midlayer."
    tensors = {
        layer + "self_attn.q_proj.weight": matrix(q, 2 * hidden),
        layer + "self_attn.k_proj.weight": matrix(kv, 2 * hidden),
        layer + "self_attn.v_proj.weight": matrix(kv, 2 * hidden),
        layer + "self_attn.o_proj.weight": matrix(hidden, q),
        layer + "mlp.gate_proj.weight": matrix(inner, hidden),
        layer + "mlp.up_proj.weight": matrix(inner, hidden),
        layer + "mlp.down_proj.weight": matrix(hidden, inner),
        layer + "input_layernorm.weight": norm(),
        layer + "hidden_norm.weight": norm(),
        layer + "post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "fc.weight": matrix(hidden, aux * hidden),
        "lm_head.weight": matrix(draft, hidden),
        "d2t": kept - torch.arange(draft),
        "t2d": t2d,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return tensors
