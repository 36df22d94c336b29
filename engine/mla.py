"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4 MoE Lite) over a paged latent cache.

Per token, a layer caches one latent row [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim
channels): c_kv, the normalized down-projection from which kv_b_proj makes every head's K (the
part without RoPE) and V, and k_pe, the RoPE'd key part that all heads share. A layer's cache is
one plane [num_blocks, 1, block_size, latent_dim], addressed by the same slots and block tables
as the K/V planes (engine.attention.AttentionMetadata).

There are two ways to attend, equal in exact arithmetic:
- expanded (`attend_expanded`, for prompts and chunks of them): the context's latents are
  up-projected to per-head K = [k_nope | k_pe] and V, then causal attention as usual;
- absorbed (`attend_absorbed`, for decode tokens): q_nope is multiplied into W_UK, the K half of
  kv_b_proj, so that each head's query lives in latent space and scores [q_nope W_UK | q_pe]
  against the cached rows directly; the latent output is mapped to V's space by W_UV. Nothing
  per head is built from the context, so a decode step reads latent rows only.

The model writes latent rows (normalizing c_kv and rotating k_pe, and q_pe with them), and
attends decode-only batches in latent space, through a `LatentBackend` chosen by whoever builds
it: this module is itself the CPU one (`store_latent`, `decode_attention`), engine.triton_mla the
CUDA one (kernels a CUDA graph can capture); a wrapper (the prefill's KV publisher) acts on each
layer's freshly written rows. Batches with prompt chunks go through `paged_mla` (torch) on
either device.
"""

from __future__ import annotations

import itertools
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, causal_attention, to_cache
from engine.config import ModelConfig
from engine.deepseek_config import YarnRopeScaling
from engine.fp8 import Fp8Weight, dense
from engine.host_values import to_device
from engine.model import Linear, ModelOps, NormInput, RMSNorm, RotaryEmbedding, rms_norm, rope

# NOTE: transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentBackend(Protocol):
    """How a layer's new latent rows reach its plane, and how a decode-only batch attends to
    its cached rows: this module's functions, engine.triton_mla's, or a wrapper of either."""

    def store_latent(
        self,
        cache: torch.Tensor,
        kv_a: torch.Tensor,
        q_pe: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        interleaved: bool,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Stores the new tokens' latent rows [rms_norm(c_kv) * norm_weight | RoPE(k_pe)] at
        their slots, from kv_a = [c_kv | k_pe] [T, kv_lora_rank + rope] (kv_a_proj_with_mqa's
        output), and returns q_pe [T, heads, rope] RoPE'd, a new tensor. RoPE by cos, sin
        [T, rope / 2] as engine.model.rope (`interleaved`: pairs come out de-interleaved)."""
        ...

    def decode_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_b_weight: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """The absorbed form for a decode-only batch: the query [q_nope | q_pe] (q_nope [n,
        heads, nope], q_pe [n, heads, rope] RoPE'd, any strides with contiguous channels), row
        i sequence i's one new token (already written), taken into latent space by W_UK
        (`absorb_query`), attends over the sequence's latent rows, the first kv_lora_rank
        channels of each being its value, and the output leaves by W_UV (`expand_output`)
        -> [n, heads, v_head_dim] contiguous."""
        ...


class MlaAttention(nn.Module):
    """One layer's MLA, with Hugging Face's parameter names (q_proj when q_lora_rank is None,
    else q_a_proj, q_a_layernorm and q_b_proj), except that the two projections of the input,
    q_proj (or q_a_proj) and kv_a_proj_with_mqa, are one: `fused_qkv_a_proj` (engine.weights
    fills its rows from both)."""

    def __init__(self, config: ModelConfig, ops: ModelOps, backend: LatentBackend) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.backend = backend
        self.num_heads = config.num_heads
        self.ops = ops
        hidden, heads = config.hidden_size, config.num_heads
        q_rows = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        self.q_a_rows = q_rows if mla.q_lora_rank is None else mla.q_lora_rank
        fp8 = config.fp8
        self.fused_qkv_a_proj = Linear(hidden, self.q_a_rows + mla.latent_dim, False, ops, fp8)
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(mla.q_lora_rank, q_rows, False, ops, fp8)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, ops)
        kv_rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = Linear(mla.kv_lora_rank, kv_rows, False, ops, fp8)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, False, ops, fp8)
        self.scale = softmax_scale(config)
        self._kv_b_dense: torch.Tensor | None = None
        self._kv_b_key: tuple | None = None

    def forward(
        self,
        inp: NormInput,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        meta: AttentionMetadata,
        next_norm: RMSNorm,
    ) -> NormInput:
        """next_norm(attention output + the input's x + residual); writes the new tokens'
        latent rows into kv_cache = (latent plane,)."""
        mla = self.mla
        qkv_a, residual = self.ops.norm_linear(inp, self.fused_qkv_a_proj.matrix, None)
        tokens = qkv_a.shape[0]
        q, kv_a = qkv_a.split([self.q_a_rows, mla.latent_dim], dim=-1)
        if mla.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(tokens, self.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        (cache,) = kv_cache
        norm = self.kv_a_layernorm
        q_pe = self.backend.store_latent(
            cache, kv_a, q_pe, norm.weight, norm.eps, cos, sin,
            mla.rope_interleave, meta.slot_mapping,
        )  # fmt: skip
        w = self._kv_b(qkv_a.dtype)
        if meta.max_query_len == 1:  # decode only: the backend's kernels (CUDA-graph safe)
            o = self.backend.decode_attention(q_nope, q_pe, cache, meta, w, self.scale)
        else:
            o = paged_mla(q_nope, q_pe, cache, meta, w, self.scale)
        return self.o_proj.add_forward(o.view(tokens, -1), residual, next_norm)

    def _kv_b(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's matrix, whose slices W_UK and W_UV the attention reads, in `dtype`. An
        fp8 one is dequantized once and kept (at the first forward, before CUDA graphs are
        captured; again should its weights change): it costs its bytes in the compute dtype
        (as vLLM's MLA keeps it), not a dequantization every step."""
        matrix = self.kv_b_proj.matrix
        if not isinstance(matrix, Fp8Weight):
            return matrix
        key = (matrix.weight.data_ptr(), matrix.weight._version, matrix.scale._version, dtype)
        if self._kv_b_key != key:
            fresh = dense(matrix, dtype)
            kept = self._kv_b_dense
            if kept is not None and kept.shape == fresh.shape and kept.dtype == fresh.dtype:
                # In place: captured CUDA graphs read this buffer, and would keep reading the
                # old weights from a replaced one (weights changed after capture).
                kept.copy_(fresh)
            else:
                self._kv_b_dense = fresh
            self._kv_b_key = key
        return self._kv_b_dense


def softmax_scale(config: ModelConfig) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale squared if set."""
    mla = config.mla
    assert mla is not None
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if isinstance(config.rope_scaling, YarnRopeScaling):
        scale *= config.rope_scaling.softmax_mscale() ** 2
    return scale


class YarnRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose cos and sin are scaled by YaRN's attention factor; the inverse
    frequencies come from `yarn_inv_freq`."""

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        scaling = self.config.rope_scaling
        assert isinstance(scaling, YarnRopeScaling)
        factor = scaling.cos_sin_scale()
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)


def yarn_inv_freq(dim: int, theta: float, scaling: YarnRopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2], float32, computed as transformers does."""

    def correction_dim(rotations: float) -> float:
        old_len = scaling.original_max_position_embeddings
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores new tokens' latent rows [T, latent_dim] at their slots of the plane, in its dtype
    (an fp8 plane as engine.attention's `to_cache` stores K and V)."""
    block_size = cache.shape[2]
    cache[slot_mapping // block_size, 0, slot_mapping % block_size] = to_cache(latent, cache.dtype)


def store_latent(
    cache: torch.Tensor,
    kv_a: torch.Tensor,
    q_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """LatentBackend.store_latent in torch: engine.model's norm and RoPE, then `write_latent`."""
    c_kv, k_pe = kv_a.split([kv_a.shape[1] - q_pe.shape[2], q_pe.shape[2]], dim=-1)
    q_pe, k_pe = rope(q_pe, k_pe[:, None], cos, sin, interleaved)
    write_latent(cache, torch.cat((rms_norm(c_kv, norm_weight, eps), k_pe[:, 0]), -1), slot_mapping)
    return q_pe


def paged_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal MLA of q_nope [T, heads, nope], q_pe [T, heads, rope] over each sequence's cached
    latents (the new tokens' already written) -> [T, heads, v_head_dim]. Decode tokens go
    together through the absorbed form, each longer query through the expanded one."""
    heads = q_nope.shape[1]
    v_dim = kv_b_weight.shape[0] // heads - q_nope.shape[2]
    out = q_nope.new_empty(q_nope.shape[0], heads, v_dim)
    starts = meta.host_query_start_loc or meta.query_start_loc.tolist()
    seq_lens = meta.host_seq_lens or meta.seq_lens.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(starts)]
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    block_size = cache.shape[2]
    if decodes:
        index = to_device(decodes, q_nope.device)
        rows = to_device([starts[i] for i in decodes], q_nope.device)
        lens = meta.seq_lens[index]
        width = -(-max(seq_lens[i] for i in decodes) // block_size)
        context = gather_latents(cache, meta.block_tables[index, :width], q_nope.dtype)
        out[rows] = attend_absorbed(q_nope[rows], q_pe[rows], context, lens, kv_b_weight, scale)
    for i, n in enumerate(query_lens):
        if n == 1:
            continue
        start, seq_len = starts[i], seq_lens[i]
        table = meta.block_tables[i : i + 1, : -(-seq_len // block_size)]
        context = gather_latents(cache, table, q_nope.dtype)[0, :seq_len]
        rows = slice(start, start + n)
        out[rows] = attend_expanded(q_nope[rows], q_pe[rows], context, kv_b_weight, scale)
    return out


def gather_latents(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[num_blocks, 1, bs, dim] plane, [n, w] block ids -> [n, w * bs, dim] latent contexts in
    `dtype` (an fp8 plane's rows widened, exactly: its scale is 1.0)."""
    blocks = cache[tables.long()]  # [n, w, 1, bs, dim]
    n, w, _, bs, dim = blocks.shape
    return blocks.reshape(n, w * bs, dim).to(dtype)


def attend_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    context: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The n queries (the last n of a context of S latent rows [S, latent_dim]) against K and V
    up-projected from the context by kv_b_weight [heads * (nope + v), kv_lora_rank]."""
    heads, nope = q_nope.shape[1:]
    seq_len, rope = context.shape[0], q_pe.shape[2]
    c_kv, k_pe = context.split([context.shape[1] - rope, rope], dim=-1)
    kv = F.linear(c_kv, kv_b_weight).view(seq_len, heads, -1)
    k_nope, v = kv.split([nope, kv.shape[2] - nope], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None].expand(seq_len, heads, rope)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    return causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale)


def attend_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    contexts: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per row (its context's last token) against its latent context [n, L, dim],
    valid up to seq_lens [n], in latent space: W_UK absorbed into q, W_UV applied after."""
    q = torch.cat((absorb_query(q_nope, kv_b_weight), q_pe), dim=-1)
    o = latent_attention(q, contexts, seq_lens, scale, kv_b_weight.shape[1])
    return expand_output(o, kv_b_weight, q_nope.shape[2])


def absorb_query(q_nope: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
    """q_nope W_UK [n, heads, kv_lora_rank], a view of a [heads, n, kv_lora_rank] tensor: each
    head's query in latent space, W_UK being the K rows of kv_b_weight [heads * (nope + v),
    kv_lora_rank]. One batched GEMM over heads (cuBLAS takes q_nope's and W_UK's strided views as
    they are: no copy)."""
    heads, nope = q_nope.shape[1:]
    w_uk = kv_b_weight.view(heads, -1, kv_b_weight.shape[1])[:, :nope]  # [heads, nope, rank]
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_output(o: torch.Tensor, kv_b_weight: torch.Tensor, nope: int) -> torch.Tensor:
    """Latent attention output [n, heads, kv_lora_rank] (any strides; [heads, n, rank] in
    memory reads best) -> V's space [n, heads, v_head_dim], contiguous, by W_UV, the V rows of
    kv_b_weight: one batched GEMM over heads writing each head's columns of the result, which
    o_proj then reads as [n, heads * v_head_dim] without a copy."""
    n, heads, rank = o.shape
    w_uv = kv_b_weight.view(heads, -1, rank)[:, nope:]  # [heads, v, rank]
    out = o.new_empty(n, heads, w_uv.shape[1])
    torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


def decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """LatentBackend.decode_attention in torch."""
    args = (q_nope, q_pe, cache, meta, kv_b_weight, scale)
    return absorbed_decode(absorb_query, attend_latent, expand_output, *args)


def absorbed_decode(absorb, attend, expand, q_nope, q_pe, cache, meta, kv_b_weight, scale):
    """LatentBackend.decode_attention from a backend's three steps: `absorb` (q_nope, kv_b) ->
    q_c, `attend` (q_c, q_pe, cache, meta, scale) -> latent output, `expand` (output, kv_b,
    nope) -> [n, heads, v_head_dim]."""
    q_c = absorb(q_nope, kv_b_weight)
    return expand(attend(q_c, q_pe, cache, meta, scale), kv_b_weight, q_nope.shape[2])


def attend_latent(
    q_c: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Latent attention of q [q_c | q_pe] (q_c = q_nope W_UK [n, heads, kv_lora_rank]) -> [n,
    heads, kv_lora_rank]: the contexts gathered, then `latent_attention`."""
    contexts = gather_latents(cache, meta.block_tables, q_c.dtype)
    q = torch.cat((q_c, q_pe), dim=-1)
    return latent_attention(q, contexts, meta.seq_lens, scale, q_c.shape[2])


def latent_attention(
    q: torch.Tensor,
    contexts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """q [n, heads, dim] against contexts [n, L, dim] valid up to seq_lens [n], with the first
    kv_lora_rank channels as values -> [n, heads, kv_lora_rank]."""
    valid = torch.arange(contexts.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    # NOTE: slots past a sequence's end may hold anything (NaN bit patterns too), and a
    # masked-out NaN still poisons softmax (NaN - inf is NaN): zero them.
    contexts = contexts.masked_fill(~valid[:, :, None], 0)[:, None]  # [n, 1, L, dim]
    o = F.scaled_dot_product_attention(
        q[:, :, None],
        contexts,
        contexts[..., :kv_lora_rank],
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [n, heads, 1, rank]
    return o[:, :, 0]
