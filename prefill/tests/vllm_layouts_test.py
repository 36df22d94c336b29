"""vLLM's cache layouts as tandem reads them. The CPU one is checked against vLLM's own CPU
kernel (it stores K transposed); the GPU ones are checked through the whole send path in
vllm_worker_side_test.py."""

from __future__ import annotations

import pytest
import torch

from prefill.vllm_layouts import cache_views, detect_cpu_layout, refuse_latent_cache

HEADS, DIM, BLOCK = 3, 64, 128  # SmolLM2's KV heads and head_dim, vLLM's CPU block size


def _vllm_cpu_write(isa):
    """What vLLM's CPU attention backend runs to store a step's K and V (do_kv_cache_update),
    with the kernels of one ISA."""

    def write(key, value, cache, slots) -> None:
        from vllm import _custom_ops as ops

        blocks, heads, block_size, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto",
        )  # fmt: skip

    return write


def _isa_vllm_picks(dtype, block_size, head_dim):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


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


def test_an_mla_model_is_refused_naming_what_is_missing():
    """vLLM's MLA cache holds one latent row per token, which no view above reads: the
    connector stops vLLM at start-up instead of sending wrong KV."""
    with pytest.raises(ValueError, match="sending vLLM's MLA latent cache is not built"):
        refuse_latent_cache("deepseek-ai/DeepSeek-V3", use_mla=True)
    refuse_latent_cache("HuggingFaceTB/SmolLM2-135M-Instruct", use_mla=False)
