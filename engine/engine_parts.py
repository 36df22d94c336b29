"""What an engine holds on its device, built from its EngineConfig: the model, the paged KV
cache sized to `kv_cache_gb`, the CUDA graphs and the executor that runs a step's device work.
Every tensor-parallel rank builds the same parts over its share of the model (`tp`): the same
block count, the same graphs, captured in the same order, so that their collectives meet."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.engine_config import DTYPES, EngineConfig
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.model_loader import Backend, load_model
from engine.spec_build import (
    Draft,
    eagle3_aux_layers,
    extra_kv_bytes_per_token,
    load_draft_model,
    reads_target_embedding,
    verify_graphs,
)
from engine.step_executor import StepExecutor
from engine.tensor_parallel import TpRank, gather_embedding


@dataclass(frozen=True)
class EngineParts:
    model_config: ModelConfig
    """The model's shape on this rank (its share of the heads under tensor parallelism)."""
    model: CausalLM
    draft: Draft | None
    kv_cache: KVCache
    max_model_len: int
    executor: StepExecutor
    proposer_embedding: torch.Tensor | None = None
    """Under tensor parallelism, with MTP layers or an EAGLE-3 head: the target's embedding,
    whole on rank 0 (its own rows are all a rank holds), for the proposer there."""


def build_parts(
    config: EngineConfig,
    wrap_attention: Callable[[Backend], Backend] | None = None,
    tp: TpRank | None = None,
) -> EngineParts:
    """The parts of rank `tp` (of the one device without it); `wrap_attention` as
    LLMEngine.build's."""
    model_config, model = load_model(config, wrap_attention, tp)
    embedding = None
    if tp is not None and reads_target_embedding(config):
        embedding = gather_embedding(model, tp.shape, tp.group)
    # Before any graph is captured: the graphs then keep them too.
    model.model.aux_layers = eagle3_aux_layers(config, model_config)
    dtype = DTYPES[config.dtype]
    # Speculation runs on rank 0 alone, its proposer whole (decode/kv_shards.py).
    draft = load_draft_model(config, model_config) if tp is None or tp.shape.rank == 0 else None
    token_bytes = model_config.kv_bytes_per_token(config.kv_dtype)
    token_bytes += extra_kv_bytes_per_token(config)
    block_bytes = token_bytes * config.block_size
    num_blocks = int(config.kv_cache_gb * 2**30) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_gb: {config.kv_cache_gb} GiB holds no block of {block_bytes} bytes"
        )
    max_model_len = _max_model_len(config, model_config.max_position_embeddings, num_blocks)
    # Every position a sequence can reach: its RoPE angles become one gather a step.
    model.model.rotary_emb.cache(max_model_len, dtype)
    kv_cache = KVCache(model_config, num_blocks, config.block_size, config.kv_dtype, config.device)
    graphs = None
    if config.cuda_graphs:
        if tp is not None:
            # Capturing runs the model's collectives, whose timeout a rank still loading its
            # weights could exceed: every rank starts capturing together.
            dist.barrier(group=tp.control)
        graphs = DecodeGraphs(model, kv_cache, config.max_num_seqs, max_model_len)
    executor = StepExecutor(
        model, kv_cache, graphs, verify_graphs(config, model, kv_cache, max_model_len)
    )
    return EngineParts(model_config, model, draft, kv_cache, max_model_len, executor, embedding)


def _max_model_len(config: EngineConfig, longest: int, num_blocks: int) -> int:
    """The context length: --max-model-len, refused past the model's `longest`
    (max_position_embeddings: positions it was not built for give wrong tokens, as vLLM warns)
    or past what the KV cache holds (a sequence must fit the whole cache alone, else it could
    wait for blocks forever). Unset: the model's longest, or what the cache holds if less."""
    held = num_blocks * config.block_size
    wanted = config.max_model_len
    if wanted is None:
        return min(longest, held)
    if wanted > longest:
        raise ValueError(
            f"max_model_len: {wanted} is past the model's max_position_embeddings {longest}; "
            "fix: lower --max-model-len, or leave it unset"
        )
    if wanted > held:
        raise ValueError(
            f"max_model_len: {wanted} tokens do not fit the KV cache, which holds {held} "
            f"({config.kv_cache_gb} GiB); fix: raise --kv-cache-gb or lower --max-model-len"
        )
    return wanted
