"""vLLM's cache layouts as tandem reads them. The CPU ones are checked against vLLM's own CPU
kernels (the dense one stores K transposed; the MLA ones store latent rows); the GPU ones are
checked through the whole send path in vllm_worker_side_test.py and vllm_mla_test.py (FlashMLA's
fp8 latent there too, against rows built as vLLM documents them)."""

from __future__ import annotations

import pytest
import torch

from prefill.kv_writes import token_rows
from prefill.vllm_layouts import (
    cache_views,
    check_latent_write,
    dense_kv_fields,
    detect_cpu_layout,
    latent_views,
    refuse_unpaired_rope,
    to_decode_rope_order,
)

HEADS, DIM, BLOCK = 3, 64, 128  # SmolLM2's KV heads and head_dim, vLLM's CPU block size


def _vllm_cpu_write(isa, kv_cache_dtype="auto"):
    """What vLLM's CPU attention backend runs to store a step's K and V (do_kv_cache_update),
    with the kernels of one ISA."""

    def write(key, value, cache, slots) -> None:
        from vllm import _custom_ops as ops

        blocks, heads, block_size, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip

    return write


def _isa_vllm_picks(dtype, block_size, head_dim, kv_cache_dtype=None):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)


def _fp8_refusal() -> str | None:
    """Why vLLM's CPU kernels hold no fp8 cache on this machine (they need AVX-512 or AMX), by
    vLLM's own check; None where they do."""
    try:
        _isa_vllm_picks(torch.float32, 32, DIM, "fp8")
    except NotImplementedError as e:
        return str(e)
    return None


FP8_REFUSAL = _fp8_refusal()
needs_fp8_cpu = pytest.mark.skipif(FP8_REFUSAL is not None, reason=f"vLLM: {FP8_REFUSAL}")
AMX = torch.cpu._is_amx_tile_supported()


# (block size, head_dim): vLLM's default CPU block; small blocks and wide heads; a head_dim
# that is no multiple of 32 (vLLM's vec16 kernels).
SHAPES = [(BLOCK, DIM), (32, 128), (16, 80)]


@pytest.mark.parametrize(("block_size", "head_dim"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_detected_reads_what_vllms_cpu_kernel_wrote(dtype, block_size, head_dim):
    """The kernel vLLM picks on this machine (AMX tiles for bf16 where the CPU has AMX)."""
    isa = _isa_vllm_picks(dtype, block_size, head_dim)
    like = torch.empty(4, HEADS, block_size, 2 * head_dim, dtype=dtype)
    layout = detect_cpu_layout(like, HEADS, head_dim, _vllm_cpu_write(isa))
    assert layout == ("vllm-cpu-amx" if isa == "amx" else "vllm-cpu")
    assert cache_views("CPU_ATTN", like, HEADS, head_dim, layout).block_size == block_size


def test_the_plain_kernels_are_read_as_vllm_cpu_on_every_machine():
    """vLLM's portable kernels (the "vec" ISA), bf16 included, whatever this CPU also has."""
    for dtype in (torch.float32, torch.bfloat16):
        like = torch.empty(2, HEADS, BLOCK, 2 * DIM, dtype=dtype)
        assert detect_cpu_layout(like, HEADS, DIM, _vllm_cpu_write("vec")) == "vllm-cpu"


@needs_fp8_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_cache_is_read_through_the_same_layouts(dtype):
    """vLLM's fp8 KV cache on CPU (uint8 to vLLM, e4m3 bytes at scale 1): the layout of the
    kernel vLLM picks for the model's dtype, each byte the e4m3 of what was written."""
    isa = _isa_vllm_picks(dtype, 32, DIM)
    like = torch.empty(4, HEADS, 32, 2 * DIM, dtype=torch.uint8)
    write = _vllm_cpu_write(isa, "fp8")
    layout = detect_cpu_layout(like, HEADS, DIM, write, key_dtype=dtype)
    assert layout == ("vllm-cpu-amx" if isa == "amx" else "vllm-cpu")
    # A written token read back through the views: its e4m3 bytes. Values on e4m3's grid (every
    # finite nonzero code, both signs): vLLM's kernel rounds others otherwise than torch, and
    # stores -0 as 0.
    codes = 1 + torch.arange(HEADS * DIM) % 0x7E
    codes = (codes | (torch.arange(HEADS * DIM) % 2 << 7)).to(torch.uint8).view(1, HEADS, DIM)
    key = codes.view(torch.float8_e4m3fn).to(dtype)
    cache = torch.zeros_like(like)
    write(key, key, cache, torch.tensor([37]))
    views = cache_views("CPU_ATTN", cache, HEADS, DIM, layout)
    blocks, rows = torch.tensor([1]), torch.tensor([5])
    assert torch.equal(token_rows(views.k, blocks, rows), codes)
    assert torch.equal(token_rows(views.v, blocks, rows), codes)


@needs_fp8_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tandems_fp8_kv_write_stores_the_bytes_vllms_cpu_kernel_stores(dtype):
    """engine.attention.to_cache against vLLM's own fp8 cache write, on values from subnormal to
    past e4m3's range: the same bytes, so a decode continuing vLLM's cache writes as vLLM."""
    from engine.attention import to_cache

    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 1e-2, 0.1, 3.0, 100.0, 1000.0]).repeat_interleave(DIM)
    key = (torch.randn(len(scales), generator=gen) * scales).view(-1, 1, DIM).to(dtype)
    key = key.expand(-1, HEADS, DIM).contiguous()
    cache = torch.zeros(len(key), HEADS, 32, 2 * DIM, dtype=torch.uint8)
    _vllm_cpu_write("vec", "fp8")(key, key, cache, torch.arange(len(key)) * 32)
    views = cache_views("CPU_ATTN", cache, HEADS, DIM, "vllm-cpu")
    theirs = token_rows(views.k, torch.arange(len(key)), torch.zeros(len(key), dtype=torch.long))
    assert torch.equal(to_cache(key, torch.float8_e4m3fn).view(torch.uint8), theirs)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "scales", "named"),
    [
        ("fp8_e5m2", (1.0, 1.0), "fp8_e5m2"),
        ("fp8", (0.5, 0.25), "k_scale 0.5 and v_scale 0.25"),
    ],
)
def test_an_fp8_cache_tandem_cannot_hold_is_refused_by_name(kv_cache_dtype, scales, named):
    cache = torch.empty(2, HEADS, BLOCK, 2 * DIM, dtype=torch.uint8)
    with pytest.raises(ValueError, match=named):
        dense_kv_fields(kv_cache_dtype, cache, *scales)


def test_the_descriptor_names_an_fp8_cache_and_its_scale():
    cache = torch.empty(2, HEADS, BLOCK, 2 * DIM, dtype=torch.uint8)
    assert dense_kv_fields("fp8", cache, 0.5, 0.5) == {"kv_dtype": "fp8_e4m3", "kv_scale": 0.5}
    bf16 = cache.to(torch.bfloat16)
    assert dense_kv_fields("auto", bf16, 1.0, 1.0) == {"kv_dtype": "bfloat16", "kv_scale": 0.0}


def test_a_cpu_kernel_storing_k_as_rows_is_refused():
    def rows(key, value, cache, slots) -> None:
        blocks, heads, block_size, _ = cache.shape
        flat = cache.view(blocks * heads, 2 * block_size, DIM)  # [block*head, K rows | V rows]
        for i, slot in enumerate(slots.tolist()):
            block, row = divmod(slot, block_size)
            flat[block * heads : (block + 1) * heads, row] = key[i]
            flat[block * heads : (block + 1) * heads, block_size + row] = value[i]

    with pytest.raises(ValueError, match=r"CPU_ATTN .* stores KV in none of the layouts"):
        detect_cpu_layout(torch.empty(2, HEADS, BLOCK, 2 * DIM), HEADS, DIM, rows)


@pytest.mark.parametrize(
    ("backend", "shape", "named"),
    [
        ("FLASH_ATTN", (2, 4, 16, 5, DIM), "FLASH_ATTN with a KV cache of shape [2, 4, 16, 5, 64]"),
        ("FLASHMLA", (4, 16, 576), "FLASHMLA with a KV cache of shape [4, 16, 576]"),
        ("CPU_ATTN", (4, HEADS, BLOCK, DIM), "expected [blocks, 3, block_size, 128]"),
    ],
)
def test_an_unknown_layout_is_refused_by_name(backend, shape, named):
    with pytest.raises(ValueError) as error:
        cache_views(backend, torch.empty(shape), HEADS, DIM)
    assert named in str(error.value)


def test_detection_names_a_shape_no_cpu_layout_has():
    def never(key, value, cache, slots) -> None:
        raise AssertionError("a cache of the wrong shape is refused before any write")

    with pytest.raises(ValueError, match=r"expected \[blocks, 3, block_size, 128\]"):
        detect_cpu_layout(torch.empty(2, HEADS, BLOCK, DIM), HEADS, DIM, never)


# -- MLA latent caches ------------------------------------------------------------------------

KV_LORA, ROPE = 512, 64  # DeepSeek-V3's latent row: c_kv, then k_pe
LATENT = KV_LORA + ROPE


def _cpu_mla_write(latent, cache, slots) -> None:
    """What vLLM's CPU_MLA backend runs to store a step's latent rows (its impl's
    do_kv_cache_update, given [blocks, block_size, row] as MLAAttention binds it)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    impl = CPUMLAImpl(
        num_heads=1, head_size=LATENT, scale=1.0, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
        attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, q_lora_rank=None,
        kv_lora_rank=KV_LORA, qk_nope_head_dim=128, qk_rope_head_dim=LATENT - KV_LORA,
        qk_head_dim=128 + LATENT - KV_LORA, v_head_dim=128, kv_b_proj=None,
    )  # fmt: skip
    kv_c, k_pe = latent[:, :KV_LORA], latent[:, None, KV_LORA:]
    impl.do_kv_cache_update(kv_c, k_pe, cache[:, 0], slots, "auto", None)


def _amx_mla_write(latent, cache, slots) -> None:
    """AMX_MLA's store (bf16 only; in vLLM's build for CPUs with AMX tiles, where vLLM picks
    AMX_MLA for MLA models)."""
    from vllm import _custom_ops as ops

    kv_c, k_pe = latent[:, :KV_LORA].contiguous(), latent[:, KV_LORA:].contiguous()
    ops.amx_mla_concat_and_cache(kv_c, k_pe, cache[:, 0], slots)


@pytest.mark.parametrize(
    ("backend", "write", "dtype", "block_size"),
    [
        ("CPU_MLA", _cpu_mla_write, torch.float32, 16),  # the CPU platform's block size for it
        ("CPU_MLA", _cpu_mla_write, torch.bfloat16, 16),
        pytest.param(
            "AMX_MLA",
            _amx_mla_write,
            torch.bfloat16,
            32,
            marks=pytest.mark.skipif(not AMX, reason="no AMX tiles: vLLM runs CPU_MLA here"),
        ),
    ],
)
def test_the_latent_view_reads_what_vllms_cpu_mla_kernels_wrote(backend, write, dtype, block_size):
    like = torch.empty(6, 1, block_size, LATENT, dtype=dtype)
    check_latent_write(backend, like, KV_LORA, ROPE, write)  # raises if it reads otherwise
    # And rows written at scattered slots of a larger cache read back through the view.
    cache = torch.zeros_like(like)
    slots = torch.tensor([5 * block_size + 2, 3, 2 * block_size, block_size - 1])
    latent = torch.randn(len(slots), LATENT).to(dtype)
    write(latent, cache, slots)
    views = latent_views(backend, cache, KV_LORA, ROPE)
    assert (views.layout, views.v, views.dtype, views.block_size) == ("vllm-mla", None, dtype,
                                                                      block_size)  # fmt: skip
    assert torch.equal(token_rows(views.k, slots // block_size, slots % block_size)[:, 0], latent)


def test_a_kernel_storing_the_latent_otherwise_is_refused():
    def rope_first(latent, cache, slots) -> None:
        rows = cache.view(-1, LATENT)
        rows[slots] = torch.cat((latent[:, KV_LORA:], latent[:, :KV_LORA]), dim=-1)

    like = torch.empty(2, 1, 16, LATENT)
    with pytest.raises(ValueError, match=r"CPU_MLA .* stores the latent in none of the layouts"):
        check_latent_write("CPU_MLA", like, KV_LORA, ROPE, rope_first)


def test_gpu_latent_caches_are_read_through_their_strides():
    """FlashMLA and the other GPU MLA backends: [blocks, block_size, 576] bf16 rows (1152 bytes
    a token), [blocks, 1, block_size, 576] since vLLM 0.32; a block may be padded."""
    padded = torch.randn(5, 70, LATENT, dtype=torch.bfloat16)  # 64 tokens a block, 6 rows pad
    for cache in (padded[:, :64], padded[:, None, :64]):
        views = latent_views("FLASHMLA", cache, KV_LORA, ROPE)
        assert views.k.shape == (5, 1, 64, LATENT) and views.k.stride()[2:] == (LATENT, 1)
        got = token_rows(views.k, torch.tensor([4, 0]), torch.tensor([63, 1]))[:, 0]
        assert torch.equal(got, torch.stack([padded[4, 63], padded[0, 1]]))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_an_e4m3_latent_cache_is_sent_as_its_bytes(kv_cache_dtype):
    """vLLM's fp8 MLA caches but fp8_ds_mla: [blocks, block_size, 576] e4m3 bytes (stored as
    uint8), one scale a layer. Sent to an fp8 decode plane as they are, k_pe's channels in
    tandem's order; the descriptor names fp8_e4m3 and the layer's scale."""
    values = torch.randn(3, 16, LATENT).to(torch.float8_e4m3fn)
    views = latent_views("TRITON_MLA", values.view(torch.uint8), KV_LORA, ROPE, kv_cache_dtype)
    assert (views.layout, views.dtype, views.block_size) == ("vllm-mla", torch.float8_e4m3fn, 16)
    read = token_rows(views.k, torch.tensor([2, 0]), torch.tensor([15, 3]))
    sent = views.convert(read)[:, 0]
    expected = to_decode_rope_order(torch.stack([values[2, 15], values[0, 3]]).float(), KV_LORA)
    assert sent.dtype == torch.float8_e4m3fn and torch.equal(sent.float(), expected)
    fields = dense_kv_fields(kv_cache_dtype, values.view(torch.uint8), 0.5, 0.5)
    assert fields == {"kv_dtype": "fp8_e4m3", "kv_scale": 0.5}


@pytest.mark.parametrize(
    ("backend", "cache", "kv_cache_dtype", "named"),
    [
        ("FLASHMLA_SPARSE", torch.empty(2, 16, 656, dtype=torch.uint8), "nvfp4_ds_mla",
         "KV cache dtype nvfp4_ds_mla"),
        ("FLASHMLA", torch.empty(2, 16, 576, dtype=torch.bfloat16), "fp8",
         "fp8 cache of torch.bfloat16 for a latent of 512 + 64"),
        ("FLASHMLA", torch.empty(2, 16, 576, dtype=torch.uint8), "fp8_e5m2",
         "KV cache dtype fp8_e5m2 (torch.uint8)"),
        ("FLASHMLA", torch.empty(2, 16, 512, dtype=torch.bfloat16), "auto",
         "expected [blocks, (1,) block_size, 576]"),
        ("FLASHMLA_SPARSE", torch.empty(2, 16, 576, dtype=torch.uint8), "fp8_ds_mla",
         "expected [blocks, (1,) block_size, 656]"),
        ("FLASHMLA_SPARSE", torch.empty(2, 16, 656, dtype=torch.bfloat16), "fp8_ds_mla",
         "fp8_ds_mla holds the bytes of a 512 + 64 latent"),
        ("FLASHMLA", torch.empty(2, 16, 576, dtype=torch.float8_e4m3fn), "auto",
         "fp8 its e4m3 elements, the others its elements"),
        ("DEEPSEEK_V32_INDEXER", torch.empty(2, 16, 576), "auto",
         "backend DEEPSEEK_V32_INDEXER: not one tandem reads"),
    ],
)  # fmt: skip
def test_a_latent_cache_tandem_cannot_send_is_refused_by_name(
    backend, cache, kv_cache_dtype, named
):
    with pytest.raises(ValueError) as error:
        latent_views(backend, cache, KV_LORA, ROPE, kv_cache_dtype)
    assert named in str(error.value)


def test_vllms_k_pe_reordered_is_what_tandems_engine_caches():
    """vLLM rotates k_pe's pairs (2i, 2i+1) where they lie (GPT-J style); tandem's engine (as
    transformers, rope_interleave) rotates them de-interleaved. The same token's latent, after
    `to_decode_rope_order`, must be tandem's."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from engine.model import rope

    torch.manual_seed(0)
    tokens = 7
    positions = torch.arange(100, 100 + tokens)
    c_kv, k_pe = torch.randn(tokens, KV_LORA), torch.randn(tokens, 1, ROPE)
    default = {"rope_type": "default", "rope_theta": 10000.0}
    with set_current_vllm_config(VllmConfig()):
        vllm_rope = get_rope(ROPE, 1024, rope_parameters=default, is_neox_style=False)
    # vLLM's torch RoPE (its CPU kernel misreads [tokens, 1, 64] views: tests/vllm_mla_test.py)
    _, vllm_k = vllm_rope.forward_static(
        positions, torch.zeros(tokens, 1, ROPE), k_pe.clone(), ROPE, ROPE,
        vllm_rope.cos_sin_cache, False,
    )  # fmt: skip
    cos, sin = vllm_rope.cos_sin_cache[positions].chunk(2, dim=-1)
    _, tandem_k = rope(torch.zeros(tokens, 1, ROPE), k_pe, cos, sin, interleaved=True)
    sent = to_decode_rope_order(torch.cat((c_kv, vllm_k[:, 0]), dim=-1), KV_LORA)
    assert torch.equal(sent[:, :KV_LORA], c_kv)
    torch.testing.assert_close(sent[:, KV_LORA:], tandem_k[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(vllm_k[:, 0], tandem_k[:, 0], atol=1e-3)  # the order matters


def test_an_mla_model_pairing_rope_channels_by_halves_is_refused():
    with pytest.raises(ValueError, match="rope_interleave false; vLLM's MLA rotates RoPE pairs"):
        refuse_unpaired_rope("m", rope_interleave=False)
    refuse_unpaired_rope("deepseek-ai/DeepSeek-V3", rope_interleave=True)
