"""Building speculative decoding's parts for an engine: the draft model, the proposer and the
simulated acceptance curve, from its EngineConfig (engine/speculative.py says what they do)."""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs, HiddenForward
from engine.draft_proposer import DraftModelProposer
from engine.eagle import Eagle3Config, Eagle3Head, load_head
from engine.engine_config import DTYPES, EngineConfig
from engine.hidden_proposer import HiddenStateProposer
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.model_loader import (
    attention_backend,
    fill,
    load_model,
    mla_kernels,
    model_ops,
    read_model_config,
)
from engine.mtp import MtpLayer
from engine.spec_acceptance import AcceptanceCurve
from engine.speculative import NgramProposer, Proposer

Draft = tuple[ModelConfig, CausalLM]

MAX_GRAPH_ROWS = 256
"""Rows (fed tokens) of the largest step with drafts captured in a CUDA graph: each bucket keeps
its float32 logits, [rows, vocab], so buckets up to 256 rows cost ~0.7 GB at a 128k vocabulary."""


def load_draft_model(config: EngineConfig, target: ModelConfig) -> Draft | None:
    """A draft_model config's draft, on the engine's device and dtype; None for other methods.
    Its vocabulary must be the target's: drafts are token ids the target verifies."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    # Whole on this device at any tensor_parallel_size: speculation runs on rank 0 alone.
    draft_config = replace(
        config, model=spec.model, speculative_config=None, tensor_parallel_size=1
    )
    model_config, model = load_model(draft_config)
    if model_config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: {spec.model} has a vocabulary of "
            f"{model_config.vocab_size} tokens, the target {config.model} has "
            f"{target.vocab_size}; a draft model must share the target's tokenizer"
        )
    if model_config.mla is not None:
        raise ValueError(
            f"speculative_config.model: {spec.model} is of the MLA family; a draft model is of "
            "the Llama family so far"
        )
    return model_config, model


def extra_kv_bytes_per_token(config: EngineConfig) -> int:
    """KV bytes a token takes besides the target's: its proposer's (their caches have the
    target's block count: they share block ids). Every tensor-parallel rank counts them, so
    that all have the same block count, though only rank 0 speculates."""
    extra = proposer_cache_config(config)
    return 0 if extra is None else extra.kv_bytes_per_token(config.kv_dtype)


def reads_target_embedding(config: EngineConfig) -> bool:
    """Whether the proposer looks tokens up in the target's embedding: MTP layers, and
    EAGLE-3 heads without an embedding of their own."""
    spec = config.speculative_config
    return spec is not None and spec.method in ("mtp", "eagle3")


def build_proposer(
    config: EngineConfig,
    target: tuple[ModelConfig, CausalLM],
    draft: Draft | None,
    num_blocks: int,
    max_model_len: int,
    embedding: torch.Tensor | None = None,
) -> Proposer | None:
    """The engine's proposer, on rank 0 (the one device): whole at any tensor_parallel_size.
    `embedding`: the target's whole embedding where its model holds a rank's rows of it."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    # Under tensor parallelism target[0] is rank 0's share of the heads; the proposer is whole.
    shape = read_model_config(config) if config.tensor_parallel_size > 1 else target[0]
    if spec.method == "mtp":
        return build_mtp(config, shape, target[1], num_blocks, max_model_len, embedding)
    if spec.method == "eagle3":
        return build_eagle3(config, shape, target[1], num_blocks, max_model_len, embedding)
    assert draft is not None
    model_config, model = draft
    model.model.rotary_emb.cache(max_model_len, DTYPES[config.dtype])
    kv_cache = KVCache(model_config, num_blocks, config.block_size, config.kv_dtype, config.device)
    graphs = catch_up = None
    if config.cuda_graphs:
        graphs = DecodeGraphs(model, kv_cache, config.max_num_seqs, max_model_len)
        rows = _graph_rows(config)
        catch_up = DecodeGraphs(model, kv_cache, rows, max_model_len, new_kv_first=True)
    return DraftModelProposer(model, kv_cache, config.max_num_batched_tokens, graphs, catch_up)


def acceptance_curve(config: EngineConfig) -> AcceptanceCurve | None:
    spec = config.speculative_config
    if spec is None or spec.acceptance_curve is None:
        return None
    return AcceptanceCurve.load(spec.acceptance_curve, spec.num_speculative_tokens, config.seed)


def proposer_cache_config(config: EngineConfig) -> ModelConfig | None:
    """The shape of the proposer's own KV cache, which a prefill fills for the prompt and sends
    with the model's: the draft model's, or the MTP layers' (as a model of their own); None for
    a proposer without one (n-gram) or no speculation."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "mtp":
        return mtp_config(config, read_model_config(config))
    if spec.method == "eagle3":
        return _eagle3_layer(config)
    return read_model_config(replace(config, model=spec.model, speculative_config=None))


def verify_graphs(
    config: EngineConfig, model: CausalLM, kv_cache: KVCache, max_model_len: int
) -> DecodeGraphs | None:
    """CUDA graphs of decode steps that feed drafts: a row per fed token, up to
    MAX_GRAPH_ROWS rows (larger steps run eagerly)."""
    if config.speculative_config is None or not config.cuda_graphs:
        return None
    rows = _graph_rows(config)
    per_seq = config.num_speculative_tokens + 1
    return DecodeGraphs(
        model, kv_cache, rows, max_model_len, new_kv_first=True, max_rows_per_seq=per_seq
    )


def _graph_rows(config: EngineConfig) -> int:
    """Rows of the largest step with drafts (or a catch-up) captured: a full batch's k + 1
    tokens each, at most MAX_GRAPH_ROWS."""
    return min(config.max_num_seqs * (config.num_speculative_tokens + 1), MAX_GRAPH_ROWS)


def mtp_config(config: EngineConfig, target: ModelConfig) -> ModelConfig | None:
    """An mtp config's layers as a model shape of their own (for their KV cache); None for
    other methods. The model must carry MTP layers."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return None
    if target.mla is None or target.num_mtp_layers < 1:
        raise ValueError(
            f"speculative_config.method mtp: model {config.model} has no multi-token-prediction "
            "layers (num_nextn_predict_layers); use method ngram or draft_model"
        )
    return replace(target, num_layers=target.num_mtp_layers)


def build_mtp(
    config: EngineConfig,
    target: ModelConfig,
    model: CausalLM,
    num_blocks: int,
    max_model_len: int,
    embedding: torch.Tensor | None = None,
) -> HiddenStateProposer:
    """The MTP layers on the engine's device (random, or the checkpoint's), over a latent cache
    of their own with the target's block count; looking tokens up in `embedding` if given."""
    latent, experts = mla_kernels(config)
    ops = model_ops(config)
    layers = []
    for index in range(target.num_mtp_layers):
        with torch.device("meta"):
            layer = MtpLayer(target, index, ops, latent, experts)
        fill(layer, config, seed_offset=1 + index)
        _give_embedding(layer, embedding)
        layers.append(layer)
    mtp = mtp_config(config, target)
    return _hidden_proposer(config, model, layers, mtp, num_blocks, max_model_len)


def eagle3_aux_layers(config: EngineConfig, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose input streams an eagle3 config's head reads (the engine's
    model keeps them: CausalLM.proposer_hidden); () for other methods."""
    eagle = _eagle3(config)
    return () if eagle is None else eagle.target_layers(target)


def build_eagle3(
    config: EngineConfig,
    target: ModelConfig,
    model: CausalLM,
    num_blocks: int,
    max_model_len: int,
    embedding: torch.Tensor | None = None,
) -> HiddenStateProposer:
    """The EAGLE-3 head on the engine's device, over a KV cache of its own with the target's
    block count; its `fc` prepares the target's recorded aux states. A head without an
    embedding of its own looks tokens up in `embedding` if given, else the target's."""
    eagle = _eagle3(config)
    num_aux = len(eagle.target_layers(target))
    head = load_head(
        eagle, config.speculative_config.model, num_aux, attention_backend(config.device),
        model_ops(config), DTYPES[config.dtype], config.device, config.seed + 1,
    )  # fmt: skip
    head.rotary_emb.cache(max_model_len, DTYPES[config.dtype])
    _give_embedding(head, embedding)
    return _hidden_proposer(
        config, model, [head], eagle.layer, num_blocks, max_model_len, head.prepare
    )


def _give_embedding(layer: MtpLayer | Eagle3Head, embedding: torch.Tensor | None) -> None:
    """A proposer layer without an embedding of its own gets `embedding` (after its weights
    are loaded: it is not one of them); None: it keeps reading the target's."""
    if embedding is not None and layer.embed_tokens is None:
        layer.embed_tokens = torch.nn.Embedding.from_pretrained(embedding, freeze=True)


def _eagle3(config: EngineConfig) -> Eagle3Config | None:
    """An eagle3 config's head (its config.json, or preset); None for other methods."""
    spec = config.speculative_config
    return None if spec is None or spec.method != "eagle3" else Eagle3Config.load(spec.model)


def _eagle3_layer(config: EngineConfig) -> ModelConfig | None:
    eagle = _eagle3(config)
    return None if eagle is None else eagle.layer


def _hidden_proposer(
    config: EngineConfig,
    model: CausalLM,
    layers: list[MtpLayer] | list[Eagle3Head],
    cache_shape: ModelConfig,
    num_blocks: int,
    max_model_len: int,
    prepare=None,
) -> HiddenStateProposer:
    """A proposer of `layers` (each a `predict`), over a cache of `cache_shape` (one layer of
    it per proposer layer), in CUDA graphs where the engine uses them."""
    kv_cache = KVCache(cache_shape, num_blocks, config.block_size, config.kv_dtype, config.device)
    graphs = None
    if config.cuda_graphs:
        graphs = [
            DecodeGraphs(
                model,
                kv_cache,
                _graph_rows(config),
                max_model_len,
                new_kv_first=True,
                forward=_predict(layer, model, kv_cache.kv_caches[i]),
                previous_width=cache_shape.hidden_size,
            )
            for i, layer in enumerate(layers)
        ]
    return HiddenStateProposer(
        layers,
        model,
        kv_cache,
        config.max_num_batched_tokens,
        config.num_speculative_tokens,
        graphs,
        prepare,
    )


def _predict(layer, target: CausalLM, cache: tuple[torch.Tensor, ...]) -> HiddenForward:
    def forward(ids, positions, meta, previous):
        return layer.predict(target, ids, positions, previous, cache, meta)

    return forward
