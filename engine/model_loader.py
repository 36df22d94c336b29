"""Building an engine's model from its EngineConfig: the shape (a preset's or a Hugging Face
folder's), the module (Llama family or the DeepSeek-V3 family), its kernels for the device
(attention backend, or for MLA the latent backend and the experts kernel; Triton on CUDA, torch
on CPU), and its weights (random or from safetensors)."""

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
from engine.model import EAGER_OPS, CausalLM, ModelOps
from engine.moe import TORCH_KERNELS, MoeKernels
from engine.tensor_parallel import TpRank, apply_tp, check_supported, tp_ops
from engine.weights import (
    checkpoint_tensors,
    init_random_weights,
    load_tensors,
    load_weights,
    random_checkpoint,
)

Backend = AttentionBackend | LatentBackend
"""What a model writes its KV through: per-head K/V (Llama family) or latent rows (MLA)."""


def load_model(
    config: EngineConfig,
    wrap_attention: Callable[[Backend], Backend] | None = None,
    tp: TpRank | None = None,
) -> tuple[ModelConfig, CausalLM]:
    """Builds the model on the meta device and fills it: from a folder, or randomly.
    `wrap_attention` decorates its backend: an AttentionBackend, or for MLA a LatentBackend.
    With `tp`, the model is that tensor-parallel rank's part (engine/tensor_parallel.py) and
    the config returned is the rank's shape."""
    model_config = read_model_config(config)
    check_supported(model_config, config.tensor_parallel_size)
    if config.device.startswith("cuda"):
        _check_cuda_experts(model_config)
    build = _builder(config, model_config, wrap_attention)
    if tp is not None:
        return _load_tp_model(config, model_config, build, tp)
    with torch.device("meta"):
        model = build(model_config, model_ops(config))
    return model_config, _fill(model, config)


def _check_cuda_experts(model_config: ModelConfig) -> None:
    """fp8 routed experts on CUDA (engine.triton_moe) step through K by divisors of a scale
    block that tl.dot can take (multiples of 16), unless one block spans a whole row."""
    fp8, moe = model_config.fp8, model_config.moe
    if fp8 is None or moe is None or fp8.block_k is None or fp8.block_k % 16 == 0:
        return
    if fp8.block_k < max(model_config.hidden_size, moe.moe_intermediate_size):
        raise ValueError(
            f"quantization_config.weight_block_size: scale blocks of {fp8.block_k} columns; "
            "the CUDA experts kernels need a multiple of 16 (DeepSeek's and GLM's are 128)"
        )


Build = Callable[[ModelConfig, ModelOps], CausalLM]
"""A model of a shape with ops (on the meta device, under torch.device("meta"))."""


def _builder(
    config: EngineConfig,
    model_config: ModelConfig,
    wrap_attention: Callable[[Backend], Backend] | None,
) -> Build:
    """The model's family over the device's kernels: the Llama family's attention backend, or
    the MLA family's latent backend and experts (engine.mla or engine.triton_mla, moe's torch
    kernels or engine.triton_moe), through `wrap_attention`'s wrapper if given."""
    if model_config.mla is not None:
        latent, experts = mla_kernels(config)
        if wrap_attention is not None:
            latent = wrap_attention(latent)
        return lambda shape, ops: DeepseekForCausalLM(shape, ops, latent, experts)
    backend = attention_backend(config.device)
    if wrap_attention is not None:
        backend = wrap_attention(backend)
    return lambda shape, ops: CausalLM(shape, backend, ops)


def _load_tp_model(
    config: EngineConfig, model_config: ModelConfig, build: Build, tp: TpRank
) -> tuple[ModelConfig, CausalLM]:
    """Rank tp.shape.rank's model, filled with its part of the checkpoint's (or of the random
    model's) Hugging Face-named tensors."""
    shape, dtype = tp.shape, DTYPES[config.dtype]
    ops = tp_ops(model_ops(config), tp.group, model_config.vocab_size)
    with torch.device("meta"):
        model = apply_tp(build(shape.local_config, ops), shape, tp.group)
    if config.random_weights:
        with torch.device("meta"):
            whole = build(model_config, model_ops(config))
        names, tensors = random_checkpoint(whole, config.seed, dtype, config.device)
        source = f"random weights of {config.model}"
    else:
        names, tensors = checkpoint_tensors(config.model)
        source = f"checkpoint {config.model}"
    load_tensors(model, names, tensors, dtype, config.device, source, shape.shard)
    return shape.local_config, model.eval()


def model_ops(config: EngineConfig) -> ModelOps:
    """Triton's fused ops on CUDA unless enforce_eager; torch's otherwise."""
    if config.device.startswith("cuda") and not config.enforce_eager:
        from engine.cuda_ops import CUDA_OPS  # imports Triton only on CUDA

        return CUDA_OPS
    return EAGER_OPS


def _fill(model: CausalLM, config: EngineConfig) -> CausalLM:
    """Materializes the meta-device model: random weights, or the folder's."""
    dtype = DTYPES[config.dtype]
    if config.random_weights:
        init_random_weights(model, config.seed, dtype, config.device)
    else:
        load_weights(model, config.model, dtype, config.device)
    return model.eval()


def read_model_config(config: EngineConfig) -> ModelConfig:
    """The shape of config.model: a preset's (random:<preset>) or a Hugging Face folder's."""
    if config.model.startswith("random:"):
        return ModelConfig.preset(config.model.removeprefix("random:"))
    folder = Path(config.model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model: {folder} is not a Hugging Face folder (no config.json)")
    return ModelConfig.from_hf_folder(folder)


def mla_kernels(config: EngineConfig) -> tuple[LatentBackend, MoeKernels]:
    """The MLA family's latent backend and experts kernels: Triton's on CUDA, torch's on CPU."""
    if config.device.startswith("cuda"):
        from engine import triton_mla, triton_moe  # Triton only on CUDA

        return triton_mla, triton_moe.KERNELS
    return mla, TORCH_KERNELS


def fill(model: torch.nn.Module, config: EngineConfig, seed_offset: int = 0) -> None:
    """Materializes a meta-built module of the model: random weights (the config's seed plus
    seed_offset), or, for an MTP layer (engine.mtp), its checkpoint layer's."""
    from engine.weights import load_mtp_weights

    if config.random_weights:
        init_random_weights(model, config.seed + seed_offset, DTYPES[config.dtype], config.device)
    else:
        load_mtp_weights(model, config.model, DTYPES[config.dtype], config.device)
    model.eval()


def attention_backend(device: str) -> AttentionBackend:
    """Triton kernels on CUDA (imported only there: CPU installs need no Triton), torch on CPU."""
    if device.startswith("cuda"):
        from engine import triton_attention

        return triton_attention
    return attention
