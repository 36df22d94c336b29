"""Tensor parallelism applied from outside the plain model: one rank's model is the model of a
narrower shape (its share of the attention heads, KV heads, MLP and expert channels), plus what
ties the ranks together.

- Column-parallel q/k/v and gate/up (MLA: q_b_proj or q_proj, kv_b_proj; each expert's
  gate/up): each rank holds its heads' and channels' rows; with fewer KV heads than ranks, each
  rank holds the one KV head its query heads read (replicated over size / kv_heads ranks).
- Row-parallel o_proj and down_proj: each rank's partial product is summed over the ranks (one
  all-reduce) before the residual add, in `ModelOps.add_linear`; a mixture-of-experts layer sums
  its routed and shared partial outputs first, then reduces once (`ModelOps.all_reduce`).
- MLA's latent (kv_a_proj_with_mqa, q_a_proj) and the router are replicated: every rank writes
  the whole latent cache, as vLLM's TP does.
- Vocabulary-parallel embedding and lm_head: each rank holds ceil(vocab / size) rows (the last
  rank's padded with zeros); a lookup sums the ranks' masked rows, the logits are gathered.

Every rank computes the same hidden states (an all-reduce hands every rank the same sum), so
rank 0 alone samples. Weights come from the same Hugging Face-named tensors as on one device,
each cut to the rank's part by `TpShape.shard` (a checkpoint's, or random ones drawn whole:
engine.weights.random_checkpoint), so TP N holds exactly the weights of TP 1. An fp8 matrix's
block scales are cut with it: each rank's part must hold whole blocks, as in vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model import CausalLM, Linear, ModelOps, NormInput

# Hugging Face projections whose output rows are split over the ranks (column-parallel), and
# those whose input columns are (row-parallel).
_ROW_SPLIT = ("q_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
_COLUMN_SPLIT = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# An fp8 checkpoint's scales: per [block_n, block_k] block of a matrix, split with it as the
# matrix is (whole blocks: _check_fp8_blocks), or one per tensor, which every part keeps.
_SCALES = {"weight_scale_inv": "blocks", "weight_scale": "tensor"}


def check_supported(model_config: ModelConfig, size: int) -> None:
    """ValueError naming what does not split over `size` ranks, or is not built for TP yet."""
    if size == 1:
        return
    what = f"tensor_parallel_size {size}"
    kv_heads = model_config.num_kv_heads
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"{what} and the model's {kv_heads} KV heads: one must divide the other (each "
            "rank holds an equal share of the heads, or one head, replicated)"
        )
    sizes = {field: getattr(model_config, field) for field in ("num_heads", "intermediate_size")}
    if model_config.moe is not None:
        sizes["moe_intermediate_size"] = model_config.moe.moe_intermediate_size
    for field, value in sizes.items():
        if value % size:
            raise ValueError(f"{what} does not divide the model's {field} ({value})")
    _check_fp8_blocks(model_config, size)


def _check_fp8_blocks(config: ModelConfig, size: int) -> None:
    """A rank's part of a block-scaled fp8 matrix must hold whole scale blocks (its rows a
    multiple of block_n where rows are split, its columns of block_k where columns are), so
    that its scales are the checkpoint's blocks it covers, as vLLM requires."""
    misfit = _fp8_misfit(config, size)
    if misfit is None:
        return
    projection, split, per_rank, block = misfit
    fits = [1] + [s for s in range(2, size) if size % s == 0 and not _fp8_misfit(config, s)]
    raise ValueError(
        f"tensor_parallel_size {size}: each rank's part of {projection} is {per_rank} {split}, "
        f"not a multiple of the fp8 scale blocks' {block} (weight_block_size "
        f"{[config.fp8.block_n, config.fp8.block_k]}); tensor_parallel_size "
        f"{', '.join(map(str, fits))} would split it"
    )


def _fp8_misfit(config: ModelConfig, size: int) -> tuple[str, str, int, int] | None:
    """The first split fp8 matrix whose rank's part holds a partial scale block: (projection,
    "rows" or "columns", how many a rank holds, the block); None if none does, or the scales
    are per tensor (every part keeps the tensor's one scale)."""
    fp8 = config.fp8
    if fp8 is None or fp8.block_n is None:
        return None
    for projection, split, per_rank in _split_parts(config, size):
        block = fp8.block_n if split == "rows" else fp8.block_k
        if per_rank % block:
            return projection, split, per_rank, block
    return None


def _split_parts(config: ModelConfig, size: int) -> list[tuple[str, str, int]]:
    """(projection, "rows" or "columns", how many of them a rank holds) of each split matrix."""
    heads = config.num_heads // size
    mla, moe = config.mla, config.moe
    if mla is None:
        kv_rows = len(rank_kv_heads(config.num_kv_heads, size, 0)) * config.head_dim
        parts = [
            ("q_proj", "rows", heads * config.head_dim),
            ("k_proj and v_proj", "rows", kv_rows),
            ("o_proj", "columns", heads * config.head_dim),
        ]
    else:
        q_name = "q_proj" if mla.q_lora_rank is None else "q_b_proj"
        parts = [
            (q_name, "rows", heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)),
            ("kv_b_proj", "rows", heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
            ("o_proj", "columns", heads * mla.v_head_dim),
        ]
    if moe is None or moe.first_k_dense_replace > 0:
        mlp = config.intermediate_size // size
        parts += [("gate_proj and up_proj", "rows", mlp), ("down_proj", "columns", mlp)]
    if moe is not None:
        experts = moe.moe_intermediate_size // size
        parts += [("the experts' gate_proj and up_proj", "rows", experts)]
        parts += [("the experts' down_proj", "columns", experts)]
    return parts


def kv_head_replicas(num_kv_heads: int, size: int) -> int:
    """Ranks holding each KV head: 1 when the heads split over the ranks; size / num_kv_heads
    when there are fewer heads than ranks (each head replicated, as vLLM does)."""
    return max(size // num_kv_heads, 1)


def rank_kv_heads(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads rank `rank` of `size` holds: its equal share, or its replicated one."""
    replicas = kv_head_replicas(num_kv_heads, size)
    per_rank = max(num_kv_heads // size, 1)
    first = rank // replicas * per_rank
    return range(first, first + per_rank)


def kv_replicas(model_config: ModelConfig, size: int) -> int:
    """Ranks holding each head of the KV cache: every rank an MLA latent (replicated), per-head
    K and V as kv_head_replicas. A sender writes each head to each rank holding it."""
    if model_config.mla is not None:
        return size
    return kv_head_replicas(model_config.num_kv_heads, size)


def cache_heads(model_config: ModelConfig, size: int, rank: int) -> range:
    """The heads of the KV cache rank `rank` holds: rank_kv_heads, or an MLA latent's one."""
    if model_config.mla is not None:
        return range(1)
    return rank_kv_heads(model_config.num_kv_heads, size, rank)


@dataclass(frozen=True)
class TpShape:
    """Rank `rank` of `size`: its part of the model's shape, and of each checkpoint tensor."""

    model_config: ModelConfig
    """The whole model's."""
    rank: int
    size: int

    @property
    def local_config(self) -> ModelConfig:
        """The shape of this rank's model: heads, KV heads and MLP channels divided."""
        c, size = self.model_config, self.size
        moe = c.moe
        if moe is not None:
            moe = dataclasses.replace(moe, moe_intermediate_size=moe.moe_intermediate_size // size)
        return dataclasses.replace(
            c,
            num_heads=c.num_heads // size,
            num_kv_heads=len(rank_kv_heads(c.num_kv_heads, size, self.rank)),
            intermediate_size=c.intermediate_size // size,
            moe=moe,
        )

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and lm_head each rank holds."""
        return -(-self.model_config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the Hugging Face-named checkpoint tensor `name` (the whole
        tensor for what every rank holds: norms)."""
        if name in _VOCAB:
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
            padding = self.vocab_rows - rows.shape[0]
            return F.pad(rows, (0, 0, 0, padding)) if padding else rows
        module, leaf = name.rsplit(".", 2)[-2:]
        scales = _SCALES.get(leaf)
        if scales == "tensor":
            return tensor  # one fp8 scale for the whole tensor: every part keeps it
        config = self.model_config
        if module in ("k_proj", "v_proj"):  # the rank's KV heads, replicated if fewer than ranks
            heads = rank_kv_heads(config.num_kv_heads, self.size, self.rank)
            start, stop = heads.start * config.head_dim, heads.stop * config.head_dim
            if scales == "blocks":  # _check_fp8_blocks: the heads' rows are whole blocks
                start, stop = start // config.fp8.block_n, stop // config.fp8.block_n
            return tensor[start:stop]
        if module in _ROW_SPLIT:
            return tensor.chunk(self.size, dim=0)[self.rank]
        if module in _COLUMN_SPLIT:
            return tensor.chunk(self.size, dim=-1)[self.rank]
        return tensor


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows [start, start + rows) of the vocabulary; a lookup sums every rank's
    part (ids outside a rank's rows give zeros there)."""

    def __init__(self, rows: int, dim: int, start: int, group: dist.ProcessGroup) -> None:
        super().__init__(rows, dim)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x


def tp_ops(ops: ModelOps, group: dist.ProcessGroup, vocab_size: int) -> ModelOps:
    """`ops` with the ranks' partial products of o_proj and down_proj summed before the
    residual add (the fused GEMV + residual + norm of one device becomes GEMV, all-reduce, and
    the norm in the op after), and the vocabulary's logits gathered."""

    def add_linear(x, weight, residual, norm_weight, eps) -> NormInput:
        out = ops.linear(x, weight, None)
        dist.all_reduce(out, group=group)
        return NormInput(out, residual, norm_weight, eps)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    return dataclasses.replace(
        ops, add_linear=add_linear, gather_vocab=gather_vocab, all_reduce=all_reduce
    )


def apply_tp(model: CausalLM, shape: TpShape, group: dist.ProcessGroup) -> CausalLM:
    """A meta-built rank model (of `shape.local_config`, with `tp_ops`) given the vocabulary's
    parallel embedding and lm_head."""
    config = shape.model_config
    decoder = model.model
    decoder.embed_tokens = VocabParallelEmbedding(
        shape.vocab_rows, config.hidden_size, shape.vocab_start, group
    )
    if model.lm_head is not None:
        model.lm_head = Linear(config.hidden_size, shape.vocab_rows, False, model.ops)
    return model


def gather_embedding(model: CausalLM, shape: TpShape, group: dist.ProcessGroup) -> torch.Tensor:
    """The vocabulary-parallel embedding's rows of every rank, whole on rank 0 (an empty
    tensor elsewhere): a collective of every rank. Rank 0's MTP layers and EAGLE-3 heads look
    tokens up in it, without collectives (they run on rank 0 alone)."""
    rows = model.model.embed_tokens.weight.contiguous()
    parts = [torch.empty_like(rows) for _ in range(shape.size)] if shape.rank == 0 else None
    dist.gather(rows, parts, dst=0, group=group)
    if parts is None:
        return rows.new_empty(0)
    return torch.cat(parts)[: shape.model_config.vocab_size]


@dataclass(frozen=True)
class TpRank:
    """What a rank's model is built with: its shape and the group its collectives run in."""

    shape: TpShape
    group: dist.ProcessGroup
    """The model's collectives (NCCL on CUDA, gloo on CPU)."""
    control: dist.ProcessGroup
    """gloo, without a practical timeout: waits that last as long as a rank's work, e.g. for
    every rank to have loaded its weights."""
