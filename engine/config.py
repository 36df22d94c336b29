"""The shape of a decoder (Llama family, or DeepSeek-V3 family with MLA attention and
mixture-of-experts), read from a Hugging Face folder or a named preset.

`ModelConfig` is what every other part of the engine sizes itself from (the model, the KV cache,
the layout fingerprint exchanged at the handshake); `mla` and `moe` carry what only the
DeepSeek-V3 family has. Anything in a Hugging Face config that would
change the math but that the model does not implement is refused here, by field name, so a model
that loads is a model that computes what Hugging Face computes.
"""

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.deepseek_config import (
    MlaConfig,
    MoeConfig,
    YarnRopeScaling,
    mla_config,
    moe_config,
    refuse_unsupported_moe,
)
from engine.fp8 import Fp8Scheme, scheme_of

# Multi-head latent attention and mixture-of-experts: engine/deepseek.py.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MLA_ARCHITECTURES,
)

# The KV cache's formats: per-head K and V planes, or one latent plane per layer (MLA).
KV_FORMAT_HND = "hnd"
KV_FORMAT_MLA_LATENT = "mla-latent"


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 RoPE frequency scaling (Hugging Face rope_type "llama3").

    Wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those shorter than original_max_position_embeddings / high_freq_factor are kept,
    and the band in between is interpolated.
    """

    factor: float  # divisor of the low frequencies (8 for Llama-3.1)
    low_freq_factor: float  # sets the wavelength above which frequencies are fully scaled
    high_freq_factor: float  # sets the wavelength below which frequencies are untouched
    original_max_position_embeddings: int  # context length of pretraining (8192 for Llama-3.1)

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "original_max_position_embeddings"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rope_scaling.{name} must be > 0, got {getattr(self, name)!r}")
        # NOTE: equal factors would divide by zero in the interpolation band.
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must be > "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only model.

    For the MLA architectures, num_kv_heads is num_heads and head_dim is mla.qk_rope_head_dim
    (RoPE's width), as transformers sets them; `mla` and `moe` hold the rest.
    """

    architecture: str  # Hugging Face class name, one of SUPPORTED_ARCHITECTURES
    vocab_size: int  # rows of the embedding and of the lm_head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP's gate and up projections
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); divides num_heads
    head_dim: int  # channels per head; even, since RoPE rotates pairs
    rope_theta: float  # RoPE base frequency
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None  # None: plain RoPE
    rms_norm_eps: float  # epsilon of every RMSNorm
    tie_word_embeddings: bool  # the lm_head reuses the embedding matrix
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2/2.5); o_proj never does
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    max_position_embeddings: int  # longest context the model supports
    eos_token_ids: tuple[int, ...]  # any of these ends generation; empty if the model names none
    bos_token_id: int | None  # prepended by the tokenizer, if the model uses one
    mla: MlaConfig | None = None  # set exactly for MLA_ARCHITECTURES
    moe: MoeConfig | None = None  # set exactly for MLA_ARCHITECTURES
    fp8: Fp8Scheme | None = None  # the decoder's projections are fp8 (engine.fp8)
    # Multi-token-prediction layers after the decoder's (DeepSeek-V3's num_nextn_predict_layers):
    # a speculative-decoding proposer (engine.mtp); generation without it ignores them.
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids must be a tuple, got {type(self.eos_token_ids)}")
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"eos_token_ids: {token} is outside [0, {self.vocab_size})")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(f"bos_token_id {self.bos_token_id} is outside [0, {self.vocab_size})")
        self._check_family()

    def _check_family(self) -> None:
        is_mla = self.architecture in MLA_ARCHITECTURES
        if is_mla != (self.mla is not None) or is_mla != (self.moe is not None):
            raise ValueError(
                f"mla and moe must be set exactly for {', '.join(MLA_ARCHITECTURES)}; "
                f"{self.architecture} has mla={self.mla is not None}, moe={self.moe is not None}"
            )
        # Each family computes the RoPE scaling it knows: Llama-3's, or YaRN for MLA.
        expected = YarnRopeScaling if is_mla else Llama3RopeScaling
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, expected):
            raise ValueError(
                f"rope_scaling {type(self.rope_scaling).__name__} is not supported for "
                f"{self.architecture}"
            )
        if self.mla is not None and self.head_dim != self.mla.qk_rope_head_dim:
            raise ValueError(
                f"head_dim ({self.head_dim}) must equal mla.qk_rope_head_dim "
                f"({self.mla.qk_rope_head_dim})"
            )

    @property
    def kv_format(self) -> str:
        """KV_FORMAT_HND (K and V per head) or KV_FORMAT_MLA_LATENT (one latent row)."""
        return KV_FORMAT_HND if self.mla is None else KV_FORMAT_MLA_LATENT

    @property
    def kv_planes(self) -> tuple[int, int, int]:
        """(planes, heads, channels) of one layer's cache: (2, num_kv_heads, head_dim) for K and
        V, (1, 1, kv_lora_rank + qk_rope_head_dim) for the MLA latent."""
        if self.mla is None:
            return 2, self.num_kv_heads, self.head_dim
        return 1, 1, self.mla.latent_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV (K and V, or the MLA latent), over all layers, of one cached token."""
        planes, heads, channels = self.kv_planes
        return self.num_layers * planes * heads * channels * dtype.itemsize

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named configuration: "tiny" for tests, or the shape of a real checkpoint."""
        from engine.presets import PRESETS  # NOTE: here: the presets are ModelConfigs

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        return PRESETS[name]

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "ModelConfig":
        """Reads config.json and, when present, generation_config.json (more eos ids)."""
        folder = Path(path)
        config = json.loads((folder / "config.json").read_text())
        gen_path = folder / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_hf_dict(config, generation)

    @classmethod
    def from_hf_dict(
        cls, d: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> "ModelConfig":
        """Parses a Hugging Face config.json dict (transformers 4.x or 5.x spelling).

        eos ids are the union of config.json's and generation_config.json's: chat checkpoints
        often list the end-of-turn token only in the latter, and stopping on any of them is what
        `generate` does.
        """
        architecture = _architecture(d)
        _refuse_unsupported_features(architecture, d)
        num_heads = _required(d, "num_attention_heads")
        rope_theta, rope_scaling = _rope(d, architecture)
        mla = mla_config(d) if architecture in MLA_ARCHITECTURES else None
        eos = _token_ids(d.get("eos_token_id"))
        if generation_config is not None:
            eos += tuple(
                t for t in _token_ids(generation_config.get("eos_token_id")) if t not in eos
            )
        return cls(
            architecture=architecture,
            vocab_size=_required(d, "vocab_size"),
            hidden_size=_required(d, "hidden_size"),
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=_required(d, "num_hidden_layers"),
            num_heads=num_heads,
            # MLA has no K/V heads of its own: every query head reads the one latent.
            num_kv_heads=num_heads if mla else d.get("num_key_value_heads") or num_heads,
            # NOTE: older configs omit head_dim (Mistral writes null): it is then implied.
            head_dim=mla.qk_rope_head_dim
            if mla
            else d.get("head_dim") or _required(d, "hidden_size") // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(_required(d, "rms_norm_eps")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes a q/k/v bias and has no config key for it.
            attention_bias=architecture == "Qwen2ForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            max_position_embeddings=_required(d, "max_position_embeddings"),
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id"),
            mla=mla,
            moe=moe_config(d, _required(d, "num_hidden_layers"), architecture) if mla else None,
            fp8=scheme_of(d.get("quantization_config")),
            num_mtp_layers=int(d.get("num_nextn_predict_layers") or 0) if mla else 0,
        )


def _architecture(d: Mapping[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"architectures must name exactly one class, got {architectures!r}")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architectures: {architectures[0]!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return architectures[0]


def _refuse_unsupported_features(architecture: str, d: Mapping[str, Any]) -> None:
    """Refuses config values that change the math in ways the model does not implement."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (supported: silu)")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if architecture in MLA_ARCHITECTURES:
        refuse_unsupported_moe(d, architecture)
    # Llama and Qwen3 put the bias on o_proj too; only Qwen2's q/k/v-only bias is implemented.
    if d.get("attention_bias") and architecture != "Qwen2ForCausalLM":
        raise ValueError(f"attention_bias=true is not supported for {architecture}")
    max_pos = _required(d, "max_position_embeddings")
    window = d.get("sliding_window")
    if architecture == "MistralForCausalLM" and window is not None and window < max_pos:
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_pos} is not supported "
            "(sliding-window attention is not implemented)"
        )
    # Qwen configs carry a sliding_window value that only applies with use_sliding_window.
    if d.get("use_sliding_window") and window is not None and window < max_pos:
        raise ValueError(
            f"use_sliding_window=true with sliding_window={window} is not supported "
            "(sliding-window attention is not implemented)"
        )


def _rope(
    d: Mapping[str, Any], architecture: str
) -> tuple[float, Llama3RopeScaling | YarnRopeScaling | None]:
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older configs write
    # rope_theta and rope_scaling at the top level, the type under "type" or "rope_type".
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling") or {}
        theta = d.get("rope_theta", 10000.0)
    else:
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_scaling.partial_rotary_factor other than 1.0 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling_cls = YarnRopeScaling if architecture in MLA_ARCHITECTURES else Llama3RopeScaling
    supported = "yarn" if scaling_cls is YarnRopeScaling else "llama3"
    if rope_type != supported:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported for {architecture} "
            f"(supported: default, {supported})"
        )
    fields = dataclasses.fields(scaling_cls)
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    missing = [name for name in required if params.get(name) is None]
    if missing:
        raise ValueError(f"rope_scaling ({rope_type}) lacks {', '.join(missing)}")
    # transformers reads a null beta as its default; the others' None means "not given".
    given = {f.name: params[f.name] for f in fields if params.get(f.name) is not None}
    return theta, scaling_cls(**given)


def _required(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{key} is missing from the model config")
    return d[key]


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
