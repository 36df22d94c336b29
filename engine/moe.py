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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import fp8
from engine.config import ModelConfig
from engine.deepseek_config import MoeConfig
from engine.fp8 import Matrix, dense
from engine.model import MLP, ModelOps, NormInput, RMSNorm, silu_and_mul


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
    which converts its weight every step), so a float32 copy saves that conversion's kernel.
    MoeKernels.route computes the logits from them."""

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


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts, and optionally its (token, slot) pairs sorted by expert."""

    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] integer expert ids, distinct within a row
    # [T * k]: the pairs' indices (token * k + slot) sorted by expert, or None (the experts
    # kernel sorts them itself, or needs no sort).
    order: torch.Tensor | None = None
    bounds: torch.Tensor | None = None  # [experts + 1] int32: expert e's are order[b[e]:b[e+1]]


@dataclass(frozen=True)
class MoeKernels:
    """How a MoE layer routes and computes its experts: TORCH_KERNELS below (CPU), or
    engine.triton_moe.KERNELS (CUDA: the router's logits in one kernel, routing and sorting in
    one, one kernel per projection and one for the sum over k plus the residual, no host
    sync)."""

    # (h [T, hidden], gate.weight [experts, hidden] float32, correction bias [experts] | None,
    # MoeConfig) -> Routing, from the logits F.linear(h.float(), gate.weight)
    route: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, MoeConfig], Routing]
    # (h [T, hidden], Routing, gate_up_proj, down_proj, residual [T, hidden] | None)
    # -> [T, hidden]: the routed experts' output, plus residual if given
    experts: Callable[
        [torch.Tensor, Routing, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
    ]
    # (h, Routing, gate_up_proj, down_proj, the shared MLP's gate_up and down matrices,
    # residual [T, hidden], the next norm's weight) -> (residual + routed + shared output, that
    # times the norm weight), the shared experts computed as more slots of the routed kernels;
    # None where they cannot be (then `experts` and the shared MLP's own ops compute the layer)
    experts_and_shared: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # (x [T, hidden], norm weight, eps, gate.weight, correction bias, MoeConfig) -> (rms_norm of
    # x, its Routing), the norm computed by the router's own kernel; None where it cannot be
    norm_and_route: Callable[..., tuple[torch.Tensor, Routing] | None] | None = None


def gather_experts(
    h: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """The sum over each token's experts e of weight * expert_e(h), in torch: one gather and two
    matmuls per expert that some token chose, so that a step reads the weights of the experts
    it touches, not all of them."""
    out = torch.zeros_like(h)
    for expert in ids.unique().tolist():
        tokens, slot = torch.where(ids == expert)
        gate_up, down = (dense(fp8.expert(w, expert), h.dtype) for w in (gate_up_proj, down_proj))
        x = silu_and_mul(F.linear(h[tokens], gate_up))
        y = F.linear(x, down) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _torch_route(
    h: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, moe: MoeConfig
) -> Routing:
    return Routing(*route(F.linear(h.float(), weight), correction_bias, moe))


def _torch_experts(
    h: torch.Tensor,
    routing: Routing,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    out = gather_experts(h, routing.weights, routing.ids, gate_up_proj, down_proj)
    return out if residual is None else residual + out


TORCH_KERNELS = MoeKernels(route=_torch_route, experts=_torch_experts)


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked, computed by `kernel`. With an Fp8Scheme
    both stacks are float8_e4m3fn, each with its row-wise scales (`<name>_scale` [experts, rows,
    k blocks] float32, engine.fp8), and the kernel takes each stack as one Fp8Weight."""

    float32_parameters = ("gate_up_proj_scale", "down_proj_scale")
    fp8_parameters = ("gate_up_proj", "down_proj")

    def __init__(self, config: ModelConfig, moe: MoeConfig, kernel: Callable) -> None:
        super().__init__()
        size, hidden = moe.moe_intermediate_size, config.hidden_size
        experts = moe.n_routed_experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, size))
        self.fp8 = config.fp8
        self.gate_up_proj_scale = self.down_proj_scale = None
        if self.fp8 is not None:
            for name, (rows, columns) in (("gate_up_proj", (2 * size, hidden)),
                                          ("down_proj", (hidden, size))):  # fmt: skip
                scales = torch.empty(experts, rows, self.fp8.k_blocks(columns))
                setattr(self, f"{name}_scale", nn.Parameter(scales, requires_grad=False))
        self.kernel = kernel

    def matrix(self, name: str) -> Matrix:
        return fp8.as_matrix(self.fp8, getattr(self, name), getattr(self, f"{name}_scale"))

    def forward(
        self, h: torch.Tensor, routing: Routing, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """sum over each token's experts e of weight * expert_e(h), plus residual if given
        -> [T, hidden]."""
        gate_up, down = self.matrix("gate_up_proj"), self.matrix("down_proj")
        return self.kernel(h, routing, gate_up, down, residual)


class MoE(nn.Module):
    """Router, routed experts and shared experts: Hugging Face's `mlp.` of a sparse layer."""

    def __init__(self, config: ModelConfig, ops: ModelOps, kernels: MoeKernels) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.ops = ops
        self.route = kernels.route
        self.experts_and_shared = kernels.experts_and_shared
        self.norm_and_route = kernels.norm_and_route
        self.gate = Router(config, moe)
        self.experts = Experts(config, moe, kernels.experts)
        # The MLP every token goes through: n_shared_experts experts as one wider SwiGLU.
        width = moe.n_shared_experts * moe.moe_intermediate_size
        self.shared_experts = MLP(config, ops, width) if width else None

    def forward(self, inp: NormInput, next_norm: RMSNorm) -> NormInput:
        """next_norm(MoE output + the input's x + residual), as engine.model.MLP."""
        h, residual, routing = self._norm_and_route(inp)
        if self.ops.all_reduce is not None:  # tensor-parallel: partial outputs, summed once
            out = self.experts(h, routing)
            if self.shared_experts is not None:
                x, _ = self.ops.gate_up_silu(inp, self.shared_experts.gate_up_proj.matrix)
                out = out + self.ops.linear(x, self.shared_experts.down_proj.matrix, None)
            return NormInput(self.ops.all_reduce(out), residual, next_norm.weight, next_norm.eps)
        if self.shared_experts is None:
            return NormInput(self.experts(h, routing), residual, next_norm.weight, next_norm.eps)
        shared = self.shared_experts
        if self.experts_and_shared is not None:
            experts = self.experts
            done = self.experts_and_shared(
                h, routing, experts.matrix("gate_up_proj"), experts.matrix("down_proj"),
                shared.gate_up_proj.matrix, shared.down_proj.matrix, residual, next_norm.weight,
            )  # fmt: skip
            if done is not None:
                out, scaled = done
                return NormInput(out, None, next_norm.weight, next_norm.eps, scaled)
        # The shared experts' SwiGLU from `inp` (on CUDA its norm is computed inside the
        # projection); the residual is added to the routed output by the experts' last kernel,
        # that sum to the shared output by its down projection's op.
        x, _ = self.ops.gate_up_silu(inp, shared.gate_up_proj.matrix)
        return shared.down_proj.add_forward(x, self.experts(h, routing, residual), next_norm)

    def _norm_and_route(self, inp: NormInput) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """(the normalized input, x + residual, its Routing): the norm inside the router's
        kernel where the kernels can (an input with no residual still to add), else its own."""
        gate = self.gate
        if self.norm_and_route is not None and inp.residual is None:
            done = self.norm_and_route(
                inp.x, inp.weight, inp.eps, gate.weight, gate.e_score_correction_bias, gate.moe
            )
            if done is not None:
                h, routing = done
                return h, inp.x, routing
        h, residual = inp.compute(self.ops)
        return h, residual, self.route(h, gate.weight, gate.e_score_correction_bias, gate.moe)
