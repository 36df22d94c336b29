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

An MLA model's layer caches one latent row per token, [c_kv | k_pe] (kv_lora_rank +
qk_rope_head_dim, 576 for DeepSeek-V3), [blocks, 1, block_size, row] as vLLM >= 0.32 hands it
over ([blocks, block_size, row] before). It is read as one head (`latent_views`) and sent in the
decode server's "mla-latent" format, which orders k_pe's channels otherwise
(`to_decode_rope_order`):

  vllm-mla             The rows in the cache's dtype (kv_cache_dtype auto, bfloat16, float16,
                       float32): CPU_MLA and AMX_MLA on CPU, FlashMLA, FlashInfer, CUTLASS,
                       Triton and FlashAttention MLA on GPU (concat_and_cache_mla), 1152 bytes
                       a token in bf16.
  vllm-mla-fp8-ds      FlashMLA's "fp8_ds_mla": 656 bytes a token, the 512 c_kv values as
                       float8_e4m3fn, their 4 float32 scales (one per 128 values), then k_pe as
                       64 bfloat16. The decode server's caches hold no fp8: sent dequantized
                       to bfloat16 (`dequantize_fp8_ds_mla`), as vLLM's own prefill reads it.

No other layout is guessed: an unknown backend, shape or KV cache dtype is refused by name. Which
CPU layout a cache has depends on the kernel vLLM picks for the machine, so `detect_cpu_layout`
writes known K and V through that kernel and keeps the layout that reads them back;
`check_latent_write` does the same for an MLA cache on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from prefill.kv_writes import token_rows, view_block_size
from prefill.ticket import FP8_KV_DTYPE, kv_dtype_fields

LAYOUT_VERSION = 1
FLASH_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
CPU_LAYOUTS = ("vllm-cpu", "vllm-cpu-amx")
LATENT_BACKENDS = (
    "CPU_MLA", "AMX_MLA", "FLASHMLA", "FLASHMLA_SPARSE", "FLASHINFER_MLA", "CUTLASS_MLA",
    "TRITON_MLA", "FLASH_ATTN_MLA",
)  # fmt: skip
"""vLLM's MLA backends whose cache holds one latent row per token."""
CPU_LATENT_BACKENDS = ("CPU_MLA", "AMX_MLA")
LATENT_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
"""vLLM kv_cache_dtype values of a cache sent in its own dtype (auto: the model's)."""
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
"""vLLM kv_cache_dtype values of an e4m3 cache (one scale a layer), sent as its bytes to an
fp8 decode cache: K and V, or MLA's latent rows (other than fp8_ds_mla's)."""
FP8_DS_MLA = "fp8_ds_mla"
FP8_DS_MLA_ROW_BYTES = 656
_FP8_DS_NOPE, _FP8_DS_TILE, _FP8_DS_ROPE = 512, 128, 64  # c_kv values, values per scale, k_pe
_AMX_TILE = 16  # tokens (K) or dimensions (V) in one AMX tile row group
_AMX_PAIR = 2  # bf16 values in one 32-bit AMX element


@dataclass(frozen=True)
class CacheViews:
    """One layer's cache as views that `kv_writes.token_rows` reads: K and V, each [num_blocks,
    num_kv_heads, block_size, head_dim] or tiled (vllm-cpu-amx); or an MLA cache's one latent
    plane as `k`, [num_blocks, 1, block_size, row]."""

    layout: str
    """Layout name, for the Hello descriptor."""
    k: torch.Tensor
    v: torch.Tensor | None = None
    """None: a latent cache, whose one plane is `k`."""
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Rows as `token_rows` reads them -> rows as sent (of `dtype`); None: sent as read."""
    sent_dtype: torch.dtype | None = None
    """The element type `convert` makes, where it is not k's."""

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        return (self.k,) if self.v is None else (self.k, self.v)

    @property
    def dtype(self) -> torch.dtype:
        """The element type sent (the descriptor's kv_dtype)."""
        return self.sent_dtype or self.k.dtype

    @property
    def block_size(self) -> int:
        return view_block_size(self.k)


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
    key_dtype: torch.dtype | None = None,
) -> str:
    """The one of CPU_LAYOUTS that CPU_ATTN's own cache update, `write(key, value, cache,
    slot_mapping)`, stores: known K and V written into a two-block scratch cache shaped like
    `like` must read back through its views. A kernel that stores KV otherwise (another CPU
    ISA, a new vLLM) stops start-up instead of sending wrong KV. key_dtype: the model's, when the
    cache holds another type (an fp8 cache, uint8 to vLLM, whose elements the same layouts
    place: the written values are small integers, exact in e4m3 at vLLM's default scale 1)."""
    key_dtype = key_dtype or like.dtype
    fp8 = like.dtype == torch.uint8
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
    key = (key % 15 + 1 if fp8 else key % 251).view(len(slots), num_kv_heads, head_dim)
    key = key.to(key_dtype)
    value = -key - 1
    write(key, value, scratch, slots)
    stored = [x.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else x for x in (key, value)]
    blocks, rows = slots // block_size, slots % block_size
    for views in candidates:
        got_k, got_v = token_rows(views.k, blocks, rows), token_rows(views.v, blocks, rows)
        if torch.equal(got_k, stored[0]) and torch.equal(got_v, stored[1]):
            return views.layout
    raise ValueError(
        f"vLLM attention backend CPU_ATTN ({like.dtype}, block size {block_size}, head_dim "
        f"{head_dim}) stores KV in none of the layouts tandem reads ({', '.join(CPU_LAYOUTS)}): "
        f"refusing to send wrong KV"
    )


def dense_kv_fields(
    kv_cache_dtype: str, cache: torch.Tensor, k_scale: float, v_scale: float
) -> dict[str, str | float]:
    """The layout descriptor's kv_dtype and kv_scale for a per-head K/V cache of vLLM's
    `kv_cache_dtype` (its cache tensor `cache`, scales k_scale and v_scale); ValueError naming
    what tandem's decode server cannot hold."""
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        if cache.element_size() != 1:
            raise ValueError(f"vLLM {kv_cache_dtype} KV cache of {cache.dtype}: expected bytes")
        if k_scale != v_scale:
            raise ValueError(
                f"vLLM fp8 KV cache with k_scale {k_scale} and v_scale {v_scale}: tandem's fp8 "
                "cache has one scale for K and V"
            )
        return dict(kv_dtype=FP8_KV_DTYPE, kv_scale=k_scale)
    if kv_cache_dtype not in LATENT_CACHE_DTYPES:
        raise ValueError(
            f"vLLM KV cache dtype {kv_cache_dtype}: tandem sends {', '.join(LATENT_CACHE_DTYPES)}"
            " caches in their dtype and fp8 (e4m3) ones as they are"
        )
    return kv_dtype_fields(cache.dtype, 0.0)


def latent_views(
    backend: str,
    cache: torch.Tensor,
    kv_lora_rank: int,
    rope_dim: int,
    kv_cache_dtype: str = "auto",
) -> CacheViews:
    """The latent plane of `cache`, one layer's MLA cache as vLLM's `register_kv_caches` hands
    it over, as one head, converting to the decode server's rows; ValueError naming the
    backend, shape or dtype when it is not one of the latent layouts above. `kv_cache_dtype`:
    the layer's (vLLM's MLAAttention.kv_cache_dtype)."""
    if backend not in LATENT_BACKENDS:
        raise ValueError(
            f"vLLM MLA attention backend {backend}: not one tandem reads (known: "
            f"{', '.join(LATENT_BACKENDS)})"
        )
    fp8 = kv_cache_dtype == FP8_DS_MLA
    e4m3 = kv_cache_dtype in FP8_CACHE_DTYPES
    if not (fp8 or e4m3) and kv_cache_dtype not in LATENT_CACHE_DTYPES:
        raise ValueError(
            f"vLLM {backend} KV cache dtype {kv_cache_dtype} ({cache.dtype}): tandem sends "
            f"latent caches of {', '.join(LATENT_CACHE_DTYPES + FP8_CACHE_DTYPES)} in their "
            f"dtype, and {FP8_DS_MLA} dequantized to bfloat16"
        )
    latent_dim = kv_lora_rank + rope_dim
    rows = cache.unsqueeze(1) if cache.dim() == 3 else cache
    width = FP8_DS_MLA_ROW_BYTES if fp8 else latent_dim
    if rows.dim() != 4 or rows.shape[1] != 1 or rows.shape[3] != width or rows.stride(3) != 1:
        raise ValueError(
            f"vLLM {backend} cache of shape {list(cache.shape)} and strides "
            f"{list(cache.stride())}: expected [blocks, (1,) block_size, {width}] with each "
            f"row contiguous ({kv_cache_dtype} latent of {latent_dim})"
        )
    fp8_latent = (_FP8_DS_NOPE, _FP8_DS_ROPE)
    one_byte = fp8 or e4m3
    if one_byte != (cache.element_size() == 1) or (fp8 and (kv_lora_rank, rope_dim) != fp8_latent):
        raise ValueError(
            f"vLLM {backend} {kv_cache_dtype} cache of {cache.dtype} for a latent of "
            f"{kv_lora_rank} + {rope_dim}: {FP8_DS_MLA} holds the bytes of a {_FP8_DS_NOPE} + "
            f"{_FP8_DS_ROPE} latent, fp8 its e4m3 elements, the others its elements"
        )
    if fp8:
        return CacheViews(
            "vllm-mla-fp8-ds", rows.view(torch.uint8), convert=_fp8_ds_mla_to_decode,
            sent_dtype=torch.bfloat16,
        )  # fmt: skip
    if e4m3:  # vLLM stores them as uint8: the same bytes, as the e4m3 elements they are
        rows = rows.view(torch.float8_e4m3fn)
    to_decode = partial(to_decode_rope_order, kv_lora_rank=kv_lora_rank)
    return CacheViews("vllm-mla", rows, convert=to_decode)


def to_decode_rope_order(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Latent rows [..., kv_lora_rank + rope_dim] as vLLM caches them -> as the decode server
    does. NOTE: vLLM's MLA rotates k_pe's RoPE pairs (2i, 2i + 1) in place (GPT-J style);
    tandem's engine, as transformers with rope_interleave, stores each pair's first channel and
    then each pair's second (engine.model.rope, interleaved), and orders q_pe the same way."""
    if rows.dtype == torch.float8_e4m3fn:  # moved as their bytes (one an element)
        return to_decode_rope_order(rows.view(torch.uint8), kv_lora_rank).view(rows.dtype)
    rope = rows[..., kv_lora_rank:]
    return torch.cat((rows[..., :kv_lora_rank], rope[..., 0::2], rope[..., 1::2]), dim=-1)


def refuse_unpaired_rope(model: str, rope_interleave: bool) -> None:
    """ValueError for an MLA model whose config pairs RoPE channels (i, i + rope_dim / 2)
    (rope_interleave false): vLLM's DeepSeek MLA rotates pairs (2i, 2i + 1) whatever the config
    says, so its latent is not the one tandem's decode server computes with."""
    if not rope_interleave:
        raise ValueError(
            f"TandemConnector: {model} has rope_interleave false; vLLM's MLA rotates RoPE "
            "pairs (2i, 2i+1) regardless, so its cached k_pe is not what tandem's decode "
            "server expects"
        )


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """[..., 656] bytes of fp8_ds_mla rows -> [..., 576] bfloat16 latent rows, in vLLM's order:
    each 128 c_kv values times their float32 scale, then k_pe as stored (vLLM's
    cp_gather_and_upconvert_fp8_kv_cache, in torch)."""
    rows = rows.contiguous()  # NOTE: dtype views below need each row's bytes at offsets % 4 == 0
    lead = rows.shape[:-1]
    nope_end = _FP8_DS_NOPE
    scales_end = nope_end + 4 * (_FP8_DS_NOPE // _FP8_DS_TILE)
    nope = rows[..., :nope_end].view(torch.float8_e4m3fn).float()
    scales = rows[..., nope_end:scales_end].view(torch.float32)
    rope = rows[..., scales_end:].view(torch.bfloat16)
    nope = nope.view(*lead, -1, _FP8_DS_TILE) * scales[..., None]
    return torch.cat((nope.view(*lead, _FP8_DS_NOPE), rope.float()), dim=-1).to(torch.bfloat16)


def _fp8_ds_mla_to_decode(rows: torch.Tensor) -> torch.Tensor:
    return to_decode_rope_order(dequantize_fp8_ds_mla(rows), _FP8_DS_NOPE)


def check_latent_write(
    backend: str,
    like: torch.Tensor,
    kv_lora_rank: int,
    rope_dim: int,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> None:
    """ValueError unless the MLA backend's own cache update, `write(latent, cache,
    slot_mapping)` with latent [T, kv_lora_rank + rope_dim], stores rows where `latent_views`
    reads them: known rows written into a two-block scratch cache shaped like `like`. A kernel
    that stores the latent otherwise (another CPU ISA, a new vLLM) stops start-up instead of
    sending wrong KV. For caches of the model's dtype (CPU's: kv_cache_dtype auto)."""
    scratch = torch.zeros((2, *like.shape[1:]), dtype=like.dtype, device=like.device)
    views = latent_views(backend, scratch, kv_lora_rank, rope_dim)
    block_size, latent_dim = views.block_size, kv_lora_rank + rope_dim
    slots = torch.tensor([block_size + 3, 1, block_size * 2 - 1, 0], device=like.device)
    latent = torch.arange(1, len(slots) * latent_dim + 1, dtype=torch.float32, device=like.device)
    latent = (latent % 251).view(len(slots), latent_dim).to(views.dtype)
    write(latent, scratch, slots)
    got = token_rows(views.k, slots // block_size, slots % block_size)[:, 0]
    if not torch.equal(got, latent):
        raise ValueError(
            f"vLLM attention backend {backend} ({like.dtype}, block size {block_size}) stores "
            f"the latent in none of the layouts tandem reads ({views.layout}): refusing to send "
            "wrong KV"
        )
