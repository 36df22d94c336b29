"""vLLM's cache layouts as tandem reads them. The CPU one is checked against vLLM's own CPU
kernel (it stores K transposed); the GPU ones are checked through the whole send path in
vllm_worker_side_test.py."""

from __future__ import annotations

import pytest
import torch

from prefill.vllm_layouts import cache_views, verify_views

HEADS, DIM, BLOCK = 3, 64, 128  # SmolLM2's KV heads and head_dim, vLLM's CPU block size


def _vllm_cpu_write(key, value, cache, slots) -> None:
    """What vLLM's CPU attention backend runs to store a step's K and V (do_kv_cache_update)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    blocks, heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    isa = _get_attn_isa(cache.dtype, block_size, DIM)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto",
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_views_read_what_vllms_cpu_kernel_wrote(dtype):
    like = torch.empty(4, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    verify_views("CPU_ATTN", like, HEADS, DIM, _vllm_cpu_write)
    assert cache_views("CPU_ATTN", like, HEADS, DIM).layout == "vllm-cpu"


def test_a_cpu_kernel_storing_k_as_rows_is_refused():
    def rows(key, value, cache, slots) -> None:
        blocks, heads, block_size, _ = cache.shape
        flat = cache.view(blocks * heads, 2 * block_size, DIM)  # [block*head, K rows | V rows]
        for i, slot in enumerate(slots.tolist()):
            block, row = divmod(slot, block_size)
            flat[block * heads : (block + 1) * heads, row] = key[i]
            flat[block * heads : (block + 1) * heads, block_size + row] = value[i]

    with pytest.raises(ValueError, match=r"CPU_ATTN .* does not store KV as the vllm-cpu layout"):
        verify_views("CPU_ATTN", torch.empty(2, HEADS, BLOCK, 2 * DIM), HEADS, DIM, rows)


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
