"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as plain torch modules.

`CausalLM.forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]` runs
one step over a packed batch (see engine.attention), writing the new tokens' K/V into the paged
cache on the way; `compute_logits` turns the rows the caller picks into float32 logits. Sampling,
scheduling and I/O live elsewhere.

Parameter names are Hugging Face's, except that q/k/v and gate/up are fused into `qkv_proj` and
`gate_up_proj` (one matmul instead of three and two); engine.weights splits checkpoints into them.
The model can be built on the meta device and materialized by engine.weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import attention as torch_attention
from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.fp8 import FP8_DTYPE, Fp8Scheme, Matrix, as_matrix, dense


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in float32 and scale after casting back, as Hugging Face does: bf16 logits
    # then match theirs bit for bit more often.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused with the next norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up, for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by `apply_rotary`; `interleaved` (DeepSeek's rope_interleave): RoPE pairs
    are adjacent channels (2i, 2i+1), and come out de-interleaved (evens' results, then odds'),
    as transformers computes them: the same permutation of q and k leaves q.k unchanged."""
    if interleaved:
        q, k = _deinterleave(q), _deinterleave(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def split_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (heads + 2 kv heads) * head_dim] -> views q [T, heads, head_dim], k, v
    [T, kv heads, head_dim]."""
    tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    return (
        q.view(tokens, num_heads, head_dim),
        k.view(tokens, num_kv_heads, head_dim),
        v.view(tokens, num_kv_heads, head_dim),
    )


@dataclass(frozen=True)
class NormInput:
    """The input of a projection that starts with an RMSNorm: rms_norm(x + residual) * weight,
    not computed yet, so that a device may compute it inside the op before it or the projection
    after it (engine.cuda_ops). Without a residual it is rms_norm(x) * weight; `scaled`, if
    given, is x * weight, stored by the op that made x."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    scaled: torch.Tensor | None = None

    def compute(self, ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normalized input, x + residual) by ops' norms."""
        if self.residual is None:
            return ops.rms_norm(self.x, self.weight, self.eps), self.x
        return ops.add_rms_norm(self.x, self.residual, self.weight, self.eps)


def linear(x: torch.Tensor, weight: Matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, an fp8 matrix dequantized into x's dtype first."""
    return F.linear(x, dense(weight, x.dtype), bias)


def qkv_rope(
    inp: NormInput,
    weight: Matrix,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the fused qkv projection of the normalized input, q and k rotated (models
    without q/k norms), and the input's x + residual."""
    h, summed = inp.compute(EAGER_OPS)
    q, k, v = split_heads(linear(h, weight, bias), num_heads, num_kv_heads)
    return (*rope(q, k, cos, sin), v, summed)


def gate_up_silu(inp: NormInput, weight: Matrix) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's first half, silu_and_mul of the fused gate_up projection of the normalized
    input, and the input's x + residual."""
    h, summed = inp.compute(EAGER_OPS)
    return silu_and_mul(linear(h, weight, None)), summed


def norm_linear(
    inp: NormInput, weight: Matrix, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection of the normalized input, and the input's x + residual."""
    h, summed = inp.compute(EAGER_OPS)
    return linear(h, weight, bias), summed


def add_linear(
    x: torch.Tensor,
    weight: Matrix,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> NormInput:
    """x @ weight.T added to the residual stream, as the input of the norm after it."""
    return NormInput(linear(x, weight, None), residual, norm_weight, eps)


@dataclass(frozen=True)
class ModelOps:
    """The model's elementwise chains and its matrix products as swappable functions, so that a
    device can put its own kernels in (engine/cuda_ops.py does for CUDA) without touching the
    model."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    linear: Callable[[torch.Tensor, Matrix, torch.Tensor | None], torch.Tensor]
    # The norm before a projection, the projection and the op after it; the residual add
    # after one: a device may compute each in one kernel.
    qkv_rope: Callable[..., tuple[torch.Tensor, ...]]
    gate_up_silu: Callable[[NormInput, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    add_linear: Callable[..., NormInput]
    norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # Logits of a shard of the vocabulary -> of all of it (tensor parallelism's lm_head,
    # engine/tensor_parallel.py); the identity on one device.
    gather_vocab: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits
    # Sums a partial output over the tensor-parallel ranks, in place; None on one device (a
    # module may then fuse the residual add into its last kernel).
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


EAGER_OPS = ModelOps(
    rms_norm, add_rms_norm, rope, linear, qkv_rope, gate_up_silu, add_linear, norm_linear
)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) computed by `ops.linear`. With an Fp8Scheme its
    weight is float8_e4m3fn and `weight_scale` [out, k blocks] float32 holds its scales
    (engine.fp8); the ops take both as one Fp8Weight (`matrix`)."""

    # What engine.weights keeps in these dtypes whatever the model's dtype.
    float32_parameters = ("weight_scale",)
    fp8_parameters = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ops: ModelOps,
        fp8: Fp8Scheme | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops
        self.fp8 = fp8
        if fp8 is None:
            self.weight_scale = None
        else:
            self.weight = nn.Parameter(self.weight.to(FP8_DTYPE), requires_grad=False)
            scales = torch.empty(out_features, fp8.k_blocks(in_features), dtype=torch.float32)
            self.weight_scale = nn.Parameter(scales, requires_grad=False)

    @property
    def matrix(self) -> Matrix:
        """The weight as the ops take it."""
        return as_matrix(self.fp8, self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.matrix, self.bias)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> NormInput:
        """norm(residual + self(x)), for the projection after it (no bias: o_proj, down_proj)."""
        assert self.bias is None
        return self.ops.add_linear(x, self.matrix, residual, norm.weight, norm.eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ModelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def input_of(self, x: torch.Tensor) -> NormInput:
        """norm(x), for the projection after it to compute."""
        return NormInput(x, None, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], float32, with Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] by cos, sin [T, head_dim / 2] (half-split pairing)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Not persistent: no checkpoint holds it; `CausalLM.init_buffers` computes it.
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.table: torch.Tensor | None = None
        """cos and sin [2, positions, head_dim / 2] of every position below a bound, once
        `cache` is called."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, head_dim / 2] in dtype, computed in float32 like Hugging Face. From the
        table where `cache` made one for this dtype: one gather instead of six kernels, the
        same values (each entry is computed by the same elementwise ops)."""
        if self.table is not None and self.table.dtype == dtype:
            cos, sin = self.table.index_select(1, positions)
            return cos, sin
        return self._compute(positions, dtype)

    def cache(self, num_positions: int, dtype: torch.dtype) -> None:
        """Tabulates cos and sin of positions [0, num_positions): `forward` then takes no
        position at or past that bound (the engine's is its context length)."""
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        self.table = torch.stack(self._compute(positions, dtype))

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: ModelOps) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.backend = backend
        self.ops = ops
        fp8 = config.fp8
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * kv_size, config.attention_bias, ops, fp8
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, False, ops, fp8)
        qk_norm = config.qk_norm
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops) if qk_norm else None

    def forward(
        self,
        inp: NormInput,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        next_norm: RMSNorm,
    ) -> NormInput:
        """next_norm(attention output + the input's x + residual)."""
        tokens = inp.x.shape[0]
        if self.q_norm is None:
            proj = self.qkv_proj
            q, k, v, residual = self.ops.qkv_rope(
                inp, proj.matrix, proj.bias, cos, sin, self.num_heads, self.num_kv_heads
            )
        else:  # Qwen3 normalizes per head, before RoPE
            h, residual = inp.compute(self.ops)
            q, k, v = split_heads(self.qkv_proj(h), self.num_heads, self.num_kv_heads)
            q, k = self.ops.rope(self.q_norm(q), self.k_norm(k), cos, sin)
        o = self.backend.attention(q, k, v, *kv_cache, meta, self.scale)
        return self.o_proj.add_forward(o.reshape(tokens, self.q_size), residual, next_norm)


class MLP(nn.Module):
    """SwiGLU of `width` channels (default: the config's intermediate_size)."""

    def __init__(self, config: ModelConfig, ops: ModelOps, width: int | None = None) -> None:
        super().__init__()
        width = width or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, False, ops, config.fp8)
        self.down_proj = Linear(width, config.hidden_size, False, ops, config.fp8)
        self.ops = ops

    def forward(self, inp: NormInput, next_norm: RMSNorm) -> NormInput:
        """next_norm(MLP output + the input's x + residual)."""
        h, residual = self.ops.gate_up_silu(inp, self.gate_up_proj.matrix)
        return self.down_proj.add_forward(h, residual, next_norm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: ModelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, backend, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(
        self,
        inp: NormInput,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        next_norm: RMSNorm,
    ) -> NormInput:
        """input_layernorm(x + residual) -> next_norm(x + residual): the residual stream is
        x + residual. Each residual add and the norm after it are left to the ops around them
        (NormInput); `next_norm` is the next layer's input norm, or the final one."""
        inp = self.self_attn(inp, cos, sin, kv_cache, meta, self.post_attention_layernorm)
        return self.mlp(inp, next_norm)


class Decoder(nn.Module):
    """Embedding, decoder layers and final norm: Hugging Face's `model.` prefix. Each layer
    (a DecoderLayer, or another family's) maps (NormInput, cos, sin, kv_cache, meta, next_norm)
    to the NormInput of the next, and has an `input_layernorm`."""

    def __init__(
        self,
        config: ModelConfig,
        layers: Sequence[nn.Module],
        ops: ModelOps,
        rotary_emb: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary_emb if rotary_emb is not None else RotaryEmbedding(config)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.aux_layers: tuple[int, ...] = ()
        """Layers whose input stream a forward also keeps, concatenated in `aux` (an EAGLE-3
        head reads them: engine.eagle)."""
        self.aux: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        inp = self.layers[0].input_layernorm.input_of(x)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        streams = []
        for i, (layer, kv_cache, next_norm) in enumerate(
            zip(self.layers, kv_caches, next_norms, strict=True)
        ):
            if i in self.aux_layers:  # the residual stream entering layer i
                streams.append(inp.x if inp.residual is None else inp.x + inp.residual)
            inp = layer(inp, cos, sin, kv_cache, meta, next_norm)
        self.aux = torch.cat(streams, dim=-1) if streams else None
        x, _ = inp.compute(self.norm.ops)
        return x


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend = torch_attention,
        ops: ModelOps = EAGER_OPS,
        decoder: Decoder | None = None,
    ) -> None:
        """A Llama-family model over `attention`, or, given a `decoder` of another family's
        layers, that one."""
        super().__init__()
        self.config = config
        self.ops = ops
        if decoder is None:
            layers = [DecoderLayer(config, attention, ops) for _ in range(config.num_layers)]
            decoder = Decoder(config, layers, ops)
        self.model = decoder
        # Tied: no lm_head at all, so nothing can untie it (materializing a meta model
        # re-creates parameters one module at a time, which would split a shared one).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, ops)
        )

    # Inference only: the KV cache is written in place, which autograd cannot follow.
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T]; kv_caches[layer] = (K, V) -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def proposer_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a speculative proposer fed hidden states reads of the last forward, whose
        output was `hidden`: its aux layers' streams if it keeps them, else `hidden`."""
        return hidden if self.model.aux is None else self.model.aux

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.gather_vocab(self.ops.linear(hidden, weight, None)).float()

    def init_buffers(self) -> None:
        """Computes the buffers no checkpoint holds (RoPE frequencies, kept float32).

        Call after materializing a meta-built model and after any dtype conversion.
        """
        rotary = self.model.rotary_emb
        rotary.inv_freq = rope_inv_freq(self.config).to(rotary.inv_freq.device)
        rotary.table = None  # of the frequencies before
