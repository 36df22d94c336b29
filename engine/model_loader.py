"""Building an engine's model from its EngineConfig: the shape (a preset's or a Hugging Face
folder's), the module (Llama family or the DeepSeek-V3 family), its attention backend for the
device, and its weights (random or from safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine import attention
from engine.attention import AttentionBackend
from engine.config import KV_FORMAT_HND, ModelConfig
from engine.deepseek import DeepseekForCausalLM
from engine.engine_config import DTYPES, EngineConfig
from engine.model import EAGER_OPS, CausalLM
from engine.weights import init_random_weights, load_weights


def load_model(
    config: EngineConfig,
    wrap_attention: Callable[[AttentionBackend], AttentionBackend] | None = None,
) -> tuple[ModelConfig, CausalLM]:
    """Builds the model on the meta device and fills it: from a folder, or randomly."""
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


def refuse_latent_kv_transfer(config: EngineConfig, server: str) -> None:
    """ValueError if config.model caches an MLA latent, which a disaggregated `server` would
    have to send or receive: that transfer is not built yet."""
    model_config = read_model_config(config)
    if model_config.kv_format != KV_FORMAT_HND:
        raise ValueError(
            f"model: {config.model} ({model_config.architecture}) cannot be served by the "
            f"{server}: KV transfer of the MLA latent ({model_config.kv_format} layout) is not "
            "built yet"
        )


def _load_mla_model(
    config: EngineConfig,
    model_config: ModelConfig,
    wrap_attention: Callable[[AttentionBackend], AttentionBackend] | None,
) -> DeepseekForCausalLM:
    """The MLA/MoE family, in plain torch on CPU: no attention backend to choose or wrap."""
    if config.device.startswith("cuda"):
        raise ValueError(
            f"device: {config.device!r} is not supported for {model_config.architecture} "
            "(MLA/MoE): the Triton MLA and MoE kernels are not built yet; use cpu"
        )
    if wrap_attention is not None:
        raise ValueError(
            f"{model_config.architecture} (MLA) has no attention backend to wrap: KV transfer "
            f"of the MLA latent ({model_config.kv_format} layout) is not built yet"
        )
    with torch.device("meta"):
        model = DeepseekForCausalLM(model_config)
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
