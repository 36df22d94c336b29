"""The DeepSeek-V3 family's parts of a model's shape (engine/config.py's ModelConfig carries
them as `mla` and `moe`): multi-head latent attention, the mixture-of-experts MLP, YaRN RoPE, and
how each is read from a Hugging Face config (anything that would change the math and is not
implemented is refused by field name)."""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (Hugging Face rope_type "yarn", as DeepSeek-V3 configures it).

    Frequencies whose wavelength fits fewer than beta_slow rotations into
    original_max_position_embeddings are divided by `factor`, those with more than beta_fast
    rotations are kept, and a linear ramp blends the band in between. cos and sin are scaled by
    `attention_factor`; with mscale_all_dim set, the attention softmax scale is multiplied by
    `softmax_mscale() ** 2` as well.
    """

    factor: float  # context extension factor (40 for DeepSeek-V3)
    original_max_position_embeddings: int  # context length of pretraining (4096 for DeepSeek-V3)
    beta_fast: float = 32.0  # rotations above which frequencies are untouched
    beta_slow: float = 1.0  # rotations below which frequencies are fully scaled
    mscale: float | None = None  # numerator's log-factor weight of the default attention_factor
    mscale_all_dim: float | None = None  # its denominator's; also scales the softmax
    attention_factor: float | None = None  # scale of cos and sin; None: derived as transformers
    truncate: bool = True  # round the ramp's bounds outwards to whole dims

    def __post_init__(self) -> None:
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rope_scaling.{name} must be > 0, got {getattr(self, name)!r}")

    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (transformers' attention_factor)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)

    def softmax_mscale(self) -> float:
        """The attention softmax scale is multiplied by the square of this."""
        return _yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V of every head are up-projected from
    one normalized latent c_kv per token, and one RoPE'd key part k_pe is shared by all heads."""

    q_lora_rank: int | None  # width of q's low-rank bottleneck; None: one q_proj
    kv_lora_rank: int  # width of the latent c_kv (512 for DeepSeek-V3)
    qk_nope_head_dim: int  # per-head q/k channels without RoPE
    qk_rope_head_dim: int  # per-head q/k channels with RoPE (k's shared by all heads); even
    v_head_dim: int  # per-head v channels
    rope_interleave: bool  # RoPE pairs are adjacent channels (2i, 2i+1), not (i, i + dim/2)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int(f"mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def latent_dim(self) -> int:
        """Channels of one cached latent row: c_kv, then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """DeepSeek mixture-of-experts MLP: a router picks num_experts_per_tok of n_routed_experts
    per token (within the topk_group best of n_group groups); shared experts see every token.
    The first first_k_dense_replace layers have a dense MLP instead."""

    n_routed_experts: int  # experts the router chooses among
    num_experts_per_tok: int  # experts per token (top-k)
    moe_intermediate_size: int  # width of each expert's SwiGLU
    n_shared_experts: int  # the shared MLP is this many experts wide; 0: none
    n_group: int  # expert groups; divides n_routed_experts
    topk_group: int  # groups a token's experts may come from
    topk_method: str  # noaux_tc, greedy or group_limited_greedy
    scoring_func: str  # sigmoid or softmax of the router logits
    norm_topk_prob: bool  # the chosen experts' weights are renormalized to sum to 1
    routed_scaling_factor: float  # the routed experts' sum is multiplied by this
    first_k_dense_replace: int  # leading layers with a dense MLP

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            _positive_int(f"moe.{name}", getattr(self, name))
        for name in ("n_group", "topk_group"):
            _positive_int(f"moe.{name}", getattr(self, name))
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method {self.topk_method!r} is not supported "
                "(supported: noaux_tc, greedy, group_limited_greedy)"
            )
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"scoring_func {self.scoring_func!r} is not supported (supported: sigmoid, softmax)"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {reachable} experts "
                "of topk_group groups"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the MoE MLP (else the dense one)."""
        return layer >= self.first_k_dense_replace


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# Routing as each architecture's transformers model computes it: (top-k methods, the default,
# scoring). DeepSeek-V3 and GLM-4 MoE Lite hard-code sigmoid scores and the bias-corrected
# grouped top-k; DeepSeek-V2 scores by softmax, greedy or group-limited, and never renormalizes.
_ROUTING = {
    "DeepseekV2ForCausalLM": (("greedy", "group_limited_greedy"), "greedy", "softmax"),
    "DeepseekV3ForCausalLM": (("noaux_tc",), "noaux_tc", "sigmoid"),
    "Glm4MoeLiteForCausalLM": (("noaux_tc",), "noaux_tc", "sigmoid"),
}


def refuse_unsupported_moe(d: Mapping[str, Any], architecture: str) -> None:
    """Refuses routing the architecture's model does not compute: a config naming it is
    another model."""
    methods, default, scoring = _ROUTING[architecture]
    if d.get("topk_method", default) not in methods:
        raise ValueError(
            f"topk_method {d['topk_method']!r} is not supported for {architecture} "
            f"(supported: {', '.join(methods)})"
        )
    if d.get("scoring_func", scoring) != scoring:
        raise ValueError(
            f"scoring_func {d['scoring_func']!r} is not supported for {architecture} "
            f"(supported: {scoring})"
        )
    # NOTE: DeepSeek-V2's own code would renormalize the top-k weights, transformers' does not;
    # every released V2 checkpoint says false, so a true one is refused rather than guessed.
    if architecture == "DeepseekV2ForCausalLM" and d.get("norm_topk_prob"):
        raise ValueError("norm_topk_prob=true is not supported for DeepseekV2ForCausalLM")
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {d['moe_layer_freq']!r} is not supported (supported: 1)")


def mla_config(d: Mapping[str, Any]) -> MlaConfig:
    return MlaConfig(
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=_required(d, "kv_lora_rank"),
        qk_nope_head_dim=_required(d, "qk_nope_head_dim"),
        qk_rope_head_dim=_required(d, "qk_rope_head_dim"),
        v_head_dim=_required(d, "v_head_dim"),
        rope_interleave=bool(d.get("rope_interleave", True)),
    )


def moe_config(d: Mapping[str, Any], num_layers: int, architecture: str) -> MoeConfig:
    _, default_method, scoring = _ROUTING[architecture]
    v2 = architecture == "DeepseekV2ForCausalLM"
    return MoeConfig(
        n_routed_experts=_required(d, "n_routed_experts"),
        num_experts_per_tok=_required(d, "num_experts_per_tok"),
        moe_intermediate_size=_required(d, "moe_intermediate_size"),
        n_shared_experts=d.get("n_shared_experts") or 0,
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        topk_method=d.get("topk_method") or default_method,
        scoring_func=scoring,
        norm_topk_prob=False if v2 else bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=_first_dense_layers(d, num_layers),
    )


def _first_dense_layers(d: Mapping[str, Any], num_layers: int) -> int:
    """first_k_dense_replace, or GLM's mlp_layer_types when it has that form (dense, then
    sparse): other interleavings are refused."""
    types = d.get("mlp_layer_types")
    if types is None:
        return d.get("first_k_dense_replace") or 0
    dense = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    if len(types) != num_layers or any(kind != "sparse" for kind in types[dense:]):
        raise ValueError(
            f"mlp_layer_types {types!r} is not supported (dense layers then sparse ones, one "
            "entry per layer)"
        )
    return dense


def _required(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{key} is missing from the model config")
    return d[key]
