"""DeepSeek's mixture-of-experts MLP: a router, routed experts and shared experts.

Per token, the router scores every routed expert (sigmoid or softmax of gate.weight @ x, in
float32) and picks num_experts_per_tok of them (`route`); their SwiGLU outputs, weighted, plus
the shared experts' output (an MLP every token goes through) are the layer's output.

Parameter names are Hugging Face's, except that each routed expert's gate and up projections
are stacked into `experts.gate_up_proj` [experts, 2 * moe_intermediate_size, hidden] and the
down projections into `experts.down_proj` [experts, hidden, moe_intermediate_size], as
transformers holds them in memory; engine.weights maps checkpoints' per-expert names into them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.deepseek_config import MoeConfig
from engine.model import Linear, ModelOps, NormInput, RMSNorm, silu_and_mul


def route(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, experts] (float32) -> (weights [T, k] float32, expert ids [T, k]).

    noaux_tc (DeepSeek-V3): experts are chosen by score + correction_bias, within the
    topk_group groups whose two best biased scores sum highest, and weighted by their unbiased
    score. group_limited_greedy (DeepSeek-V2): groups ranked by their best score. greedy: the
    top-k scores. Then norm_topk_prob renormalizes the weights, and routed_scaling_factor
    multiplies them.
    """
    scores = logits.sigmoid() if moe.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.topk_method != "greedy" and moe.n_group > 1:
        grouped = choice.view(choice.shape[0], moe.n_group, -1)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[2]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best = group_scores.topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        # Masked to -inf, or to 0 as transformers' DeepSeek-V2 does (scores are >= 0 there).
        fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
        choice = grouped.masked_fill(~keep[:, :, None], fill).flatten(1)
    ids = choice.topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Module):
    """gate.weight [experts, hidden] and gate.e_score_correction_bias [experts] (noaux_tc) kept
    in float32 whatever the model's dtype: the router computes in float32 (as transformers does,
    which converts its weight every step), so a float32 copy saves that conversion's kernel."""

    float32_parameters = ("weight", "e_score_correction_bias")

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.n_routed_experts, dtype=torch.float32))
            if moe.topk_method == "noaux_tc"
            else None
        )

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        logits = F.linear(h.float(), self.weight)
        return route(logits, self.e_score_correction_bias, self.moe)


ExpertsKernel = Callable[..., torch.Tensor]
"""(h [T, hidden], weights [T, k] float32, ids [T, k], gate_up_proj, down_proj) -> [T, hidden]:
the sum over each token's experts e of weight * expert_e(h). `gather_experts` below (CPU), or
engine.triton_moe.fused_experts (CUDA: one kernel per projection, no host sync)."""


def gather_experts(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """ExpertsKernel in torch: one gather and two matmuls per expert that some token chose, so
    that a step reads the weights of the experts it touches, not all of them."""
    out = torch.zeros_like(h)
    for expert in ids.unique().tolist():
        tokens, slot = torch.where(ids == expert)
        x = silu_and_mul(F.linear(h[tokens], gate_up_proj[expert]))
        y = F.linear(x, down_proj[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked, computed by `kernel`."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, kernel: ExpertsKernel) -> None:
        super().__init__()
        size = moe.moe_intermediate_size
        experts = moe.n_routed_experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(experts, config.hidden_size, size))
        self.kernel = kernel

    def forward(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's experts e of weight * expert_e(h) -> [T, hidden]."""
        return self.kernel(h, weights, ids, self.gate_up_proj, self.down_proj)


class SharedExperts(nn.Module):
    """The MLP every token goes through: n_shared_experts experts as one wider SwiGLU."""

    def __init__(self, config: ModelConfig, width: int, ops: ModelOps) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, False, ops)
        self.down_proj = Linear(width, config.hidden_size, False, ops)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(h)))


class MoE(nn.Module):
    """Router, routed experts and shared experts: Hugging Face's `mlp.` of a sparse layer."""

    def __init__(self, config: ModelConfig, ops: ModelOps, kernel: ExpertsKernel) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.ops = ops
        self.gate = Router(config, moe)
        self.experts = Experts(config, moe, kernel)
        width = moe.n_shared_experts * moe.moe_intermediate_size
        self.shared_experts = SharedExperts(config, width, ops) if width else None

    def forward(self, inp: NormInput, next_norm: RMSNorm) -> NormInput:
        """next_norm(MoE output + the input's x + residual), as engine.model.MLP."""
        h, residual = inp.compute(self.ops)
        weights, ids = self.gate(h)
        out = self.experts(h, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return NormInput(out, residual, next_norm.weight, next_norm.eps)
