"""The DeepSeek-V3 family decoder (DeepSeek-V3, GLM-4 MoE Lite) as plain torch modules.

The same contract as engine.model.CausalLM — `forward(input_ids [T], positions [T], kv_caches,
meta) -> hidden [T, hidden_size]`, `compute_logits`, `init_buffers` — with MLA attention
(engine.mla) over one latent plane per layer (kv_caches[layer] = (latent,)) and, past the first
first_k_dense_replace layers, a mixture-of-experts MLP (engine.moe). Parameter names are Hugging
Face's, with the fusions of engine.model and engine.moe; the model can be built on the meta
device and materialized by engine.weights.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import mla as torch_mla
from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.deepseek_config import YarnRopeScaling
from engine.mla import LatentBackend, MlaAttention, YarnRotaryEmbedding, yarn_inv_freq
from engine.model import (
    EAGER_OPS,
    MLP,
    CausalLM,
    Decoder,
    ModelOps,
    NormInput,
    RMSNorm,
    RotaryEmbedding,
    rope_inv_freq,
)
from engine.moe import TORCH_KERNELS, MoE, MoeKernels


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: ModelOps,
        latent: LatentBackend,
        experts: MoeKernels,
    ) -> None:
        super().__init__()
        assert config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = MlaAttention(config, ops, latent)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        sparse = config.moe.is_sparse(layer)
        self.mlp = MoE(config, ops, experts) if sparse else MLP(config, ops)

    def forward(
        self,
        inp: NormInput,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        meta: AttentionMetadata,
        next_norm: RMSNorm,
    ) -> NormInput:
        """input_layernorm(x + residual) -> next_norm(x + residual), as engine.model's layer."""
        inp = self.self_attn(inp, cos, sin, kv_cache, meta, self.post_attention_layernorm)
        return self.mlp(inp, next_norm)


class DeepseekForCausalLM(CausalLM):
    """CausalLM's forward, logits and buffers over DeepSeek decoder layers, which write and
    attend their latent rows through `latent` (engine.mla itself on CPU, engine.triton_mla on
    CUDA, or a wrapper of either) and route and compute experts with `experts`."""

    def __init__(
        self,
        config: ModelConfig,
        ops: ModelOps = EAGER_OPS,
        latent: LatentBackend = torch_mla,
        experts: MoeKernels = TORCH_KERNELS,
    ) -> None:
        if config.mla is None or config.moe is None:
            raise ValueError(f"{config.architecture} is not an MLA/MoE architecture")
        yarn = isinstance(config.rope_scaling, YarnRopeScaling)
        layers = [
            DeepseekDecoderLayer(config, i, ops, latent, experts) for i in range(config.num_layers)
        ]
        rotary = YarnRotaryEmbedding(config) if yarn else RotaryEmbedding(config)
        super().__init__(config, ops=ops, decoder=Decoder(config, layers, ops, rotary))

    def init_buffers(self) -> None:
        """Computes the RoPE frequencies (YaRN's when configured), kept float32."""
        rotary = self.model.rotary_emb
        scaling = self.config.rope_scaling
        if isinstance(scaling, YarnRopeScaling):
            inv_freq = yarn_inv_freq(self.config.head_dim, self.config.rope_theta, scaling)
        else:
            inv_freq = rope_inv_freq(self.config)
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device)
        rotary.table = None  # of the frequencies before
