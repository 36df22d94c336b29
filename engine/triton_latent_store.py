"""The new tokens' latent rows of an MLA layer, made and stored by one Triton kernel.

`_store_latent_kernel`, grid (token,): one token's kv_a_layernorm of c_kv, RoPE of k_pe and the
store of [c_kv | k_pe] to its slot, read straight from kv_a_proj_with_mqa's output, and the RoPE
of its q_pe heads: the four kernels of the eager path (norm, rope, cat, copy) in one. Compiled for
sm_90 (Triton 3.6): 32 registers a thread with 16 heads, 127 with DeepSeek-V3's 128; no spills.
Part of engine.triton_mla's LatentBackend.
"""

import torch
import triton
import triton.language as tl

from engine import triton_pdl
from engine.triton_ops import _rotate, rms_normalized, to_cache


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
    """engine.mla.LatentBackend.store_latent in one kernel: the new tokens' rows [rms_norm(c_kv)
    * norm_weight | RoPE(k_pe)] from kv_a [T, kv_lora_rank + rope] (strided rows allowed) into
    the plane [num_blocks, 1, block_size, latent_dim] at slot_mapping [T] int64, and q_pe [T,
    heads, rope] (a strided view allowed) RoPE'd into a new contiguous tensor. Rounding as
    engine.triton_ops' rms_norm and rope; an fp8 plane stores the rounded rows as
    engine.triton_ops' `to_cache` does."""
    num_tokens, latent_dim = kv_a.shape
    _, num_heads, rope_dim = q_pe.shape
    rank = latent_dim - rope_dim
    assert cache.shape[1] == 1 and cache.shape[3] == latent_dim, (cache.shape, kv_a.shape)
    assert cache.stride(-1) == kv_a.stride(-1) == q_pe.stride(-1) == 1
    assert norm_weight.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens == 0:
        return q_out
    pdl = triton_pdl.enabled(kv_a.device)
    _store_latent_kernel[(num_tokens,)](
        kv_a, q_pe, norm_weight, cos, sin, slot_mapping, cache, q_out, eps,
        kv_a.stride(0), q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1),
        cache.stride(0), cache.stride(2), cache.shape[2],
        RANK=rank, RANK_PAD=triton.next_power_of_2(rank), NUM_HEADS=num_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HALF=rope_dim // 2, HALF_PAD=triton.next_power_of_2(rope_dim // 2),
        INTERLEAVED=interleaved, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return q_out


@triton.jit
def _store_latent_kernel(
    kv_a_ptr,  # [T, RANK + 2 * HALF], rows stride_at apart
    q_pe_ptr,  # [T, heads, 2 * HALF]
    w_ptr,  # [RANK]: kv_a_layernorm's weight
    cos_ptr,  # [T, HALF]
    sin_ptr,
    slot_ptr,  # [T] int64
    cache_ptr,  # [blocks, 1, block_size, RANK + 2 * HALF]
    q_out_ptr,  # [T, heads, 2 * HALF]
    eps,
    stride_at,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_cb,
    stride_ct,
    block_size,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, RANK_PAD)
    mask = dims < RANK
    half = tl.arange(0, HALF_PAD)
    triton_pdl.await_previous_kernel(PDL)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
    row = kv_a_ptr + token * stride_at
    # kv_a_layernorm as triton_ops' rms_norm: normalized in fp32, rounded, scaled, rounded;
    # then stored in the cache's dtype (an fp8 plane's: `to_cache`).
    x = tl.load(row + dims, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / RANK + eps)
    w = tl.load(w_ptr + dims, mask=mask, other=0.0)
    normed = rms_normalized(x, inv_rms, w).to(x.dtype)
    tl.store(dst + dims, to_cache(normed, cache_ptr), mask=mask)
    cos = tl.load(cos_ptr + token * HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
    _rotate(row + RANK, dst + RANK, 0, 0, cos, sin, 1, half, HALF, 1, INTERLEAVED)
    _rotate(
        q_pe_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh,
        cos, sin, NUM_HEADS, half, HALF, HEADS_PAD, INTERLEAVED,
    )  # fmt: skip
