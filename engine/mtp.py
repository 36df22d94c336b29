"""Multi-token prediction (DeepSeek-V3, GLM-5): the model's own MTP layer proposes drafts.

An MTP layer (checkpoint layer num_layers + i) predicts the token after next: at position j it
takes the target's hidden state h_j (its output after the final norm) and the embedding of
token j + 1 (zeroed at position 0), normalizes each (enorm, hnorm), projects their
concatenation (eh_proj) to the model's width, runs one decoder layer of the model's kind (MLA
attention over a latent cache of its own, and the MoE MLP), and gives its hidden state g_j
(before the shared head's norm) and logits over the vocabulary (shared_head.norm, then
shared_head.head). Deeper drafts chain the layer on itself: draft d + 1 comes from g of draft
d's position and draft d's token, layer d mod num_mtp_layers. The embedding is the target's
(DeepSeek-V3's checkpoints store an identical copy with the layer, not loaded); under tensor
parallelism, where the target holds a rank's rows, the layer (on rank 0) gets it whole.

engine.hidden_proposer proposes with these layers (as it does with EAGLE-3 heads).
"""

from __future__ import annotations

import torch

from engine import mla as torch_mla
from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from engine.mla import LatentBackend
from engine.model import EAGER_OPS, Linear, ModelOps, RMSNorm
from engine.moe import TORCH_KERNELS, MoeKernels


class SharedHead(torch.nn.Module):
    def __init__(self, config: ModelConfig, ops: ModelOps) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.head = Linear(config.hidden_size, config.vocab_size, False, ops)


class MtpLayer(DeepseekDecoderLayer):
    """One MTP layer: a decoder layer of the model (its parameters under the checkpoint's names,
    relative to `model.layers.<num_layers + index>.`) with enorm, hnorm, eh_proj and
    shared_head around it."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        ops: ModelOps = EAGER_OPS,
        latent: LatentBackend = torch_mla,
        experts: MoeKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(config, config.num_layers + index, ops, latent, experts)
        self.config = config
        self.layer_index = config.num_layers + index
        self.ops = ops
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, ops)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, ops)
        self.eh_proj = Linear(2 * hidden, hidden, False, ops)
        self.shared_head = SharedHead(config, ops)
        self.embed_tokens: torch.nn.Embedding | None = None
        """The target's, whole (set after loading) where the target holds a tensor-parallel
        rank's rows of it; None: the target's own."""

    def init_buffers(self) -> None:
        """Nothing of its own: RoPE is the target's (engine.weights calls this after filling)."""

    @torch.inference_mode()
    def predict(
        self,
        target: DeepseekForCausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, hidden], logits [T, vocab] float32) for tokens `input_ids` at `positions`,
        each with the hidden state before it (the target's, or g of the draft before).
        `logit_rows`: the logits of these rows only (a whole prompt's would not fit)."""
        embed = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        embedded = embed(input_ids)
        embedded = torch.where((positions == 0)[:, None], 0.0, embedded).to(embedded.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        cos, sin = target.model.rotary_emb(positions, x.dtype)
        inp = self.forward(
            self.input_layernorm.input_of(x), cos, sin, kv_cache, meta, self.shared_head.norm
        )
        normed, g = inp.compute(self.ops)
        if logit_rows is not None:
            normed = normed[logit_rows]
        return g, self.ops.linear(normed, self.shared_head.head.matrix, None).float()
