"""Building an engine's model from its EngineConfig: the shape (a preset's or a Hugging Face
folder's), the module (Llama family or the DeepSeek-V3 family), its attention backend for the
device (for MLA, the latent backend: engine.mla), and its weights (random or from safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine import attention, mla
from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.deepseek import DeepseekForCausalLM
from engine.engine_config import DTYPES, EngineConfig
from engine.mla import LatentBackend
from engine.model import EAGER_OPS, CausalLM
from engine.weights import init_random_weights, load_weights

Backend = AttentionBackend | LatentBackend
"""What a model writes its KV through: per-head K/V (Llama family) or latent rows (MLA)."""


def load_model(
    config: EngineConfig,
    wrap_attention: Callable[[Backend], Backend] | None = None,
) -> tuple[ModelConfig, CausalLM]:
    """Builds the model on the meta device and fills it: from a folder, or randomly.
    `wrap_attention` decorates its backend: an AttentionBackend, or for MLA a LatentBackend."""
    dtype = DTYPES[config.dtype]
    model_config = read_model_config(config)
    cuda = config.device.startswith("cuda")
    if model_config.mla is not None:
        return model_config, _load_mla_model(config, model_config, wrap_attention)
    ops = EAGER_OPS
    if cuda and not config.enforce_eager:
        from engine.cuda_ops import CUDA_OPS  # imports Triton only on CUDA

        ops = CUDA_OPS
    backend = attention_backend(config.device)
    if wrap_attention is not None:
        backend = wrap_attention(backend)
    with torch.device("meta"):
        model = CausalLM(model_config, backend, ops)
    if config.model.startswith("random:"):
        init_random_weights(model, config.seed, dtype, config.device)
    else:
        load_weights(model, config.model, dtype, config.device)
    return model_config, model.eval()


def read_model_config(config: EngineConfig) -> ModelConfig:
    """The shape of config.model: a preset's (random:<preset>) or a Hugging Face folder's."""
    if config.model.startswith("random:"):
        return ModelConfig.preset(config.model.removeprefix("random:"))
    folder = Path(config.model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model: {folder} is not a Hugging Face folder (no config.json)")
    return ModelConfig.from_hf_folder(folder)


def _load_mla_model(
    config: EngineConfig,
    model_config: ModelConfig,
    wrap_attention: Callable[[Backend], Backend] | None,
) -> DeepseekForCausalLM:
    """The MLA/MoE family, in plain torch on CPU: engine.mla writes the latent rows, through
    `wrap_attention`'s wrapper if given."""
    if config.device.startswith("cuda"):
        raise ValueError(
            f"device: {config.device!r} is not supported for {model_config.architecture} "
            "(MLA/MoE): the Triton MLA and MoE kernels are not built yet; use cpu"
        )
    latent: LatentBackend = mla
    if wrap_attention is not None:
        latent = wrap_attention(latent)
    with torch.device("meta"):
        model = DeepseekForCausalLM(model_config, latent=latent)
    if config.model.startswith("random:"):
        init_random_weights(model, config.seed, DTYPES[config.dtype], config.device)
    else:
        load_weights(model, config.model, DTYPES[config.dtype], config.device)
    return model.eval()


def attention_backend(device: str) -> AttentionBackend:
    """Triton kernels on CUDA (imported only there: CPU installs need no Triton), torch on CPU."""
    if device.startswith("cuda"):
        from engine import triton_attention

        return triton_attention
    return attention
