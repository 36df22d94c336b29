import random

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import BlockPool, KVCache, fork_blocks


def _assert_empty(pool):
    """Leak check: every block is back, and the free runs merged into one range again."""
    assert pool.num_free == pool.num_total
    assert all(pool.refcount(i) == 0 for i in range(pool.num_total))
    assert pool.allocate(pool.num_total) == list(range(pool.num_total))
    pool.free(range(pool.num_total))


def test_allocate_hands_out_exact_contiguous_ids():
    pool = BlockPool(10)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(4) == [3, 4, 5, 6]
    assert pool.num_free == 3
    pool.free([0, 1, 2])
    assert pool.allocate(2) == [0, 1]
    # Free now: 2 and 7-9. No run holds 4, so the longest run goes first, then the rest.
    assert pool.allocate(4) == [2, 7, 8, 9]
    assert pool.num_free == 0
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []
    pool.free([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    _assert_empty(pool)


def test_allocate_prefers_a_run_that_fits_over_lower_ids():
    pool = BlockPool(12)
    assert pool.allocate(12) == list(range(12))
    pool.free([1, 5, 6, 7, 8, 10])
    assert pool.allocate(3) == [5, 6, 7]
    assert pool.allocate(1) == [1]  # first fit: the lowest run
    assert pool.allocate(3) is None  # 8 and 10 are free, but only two
    assert pool.allocate(2) == [8, 10]
    pool.free(range(12))
    _assert_empty(pool)


def test_refcounts_keep_shared_blocks_until_the_last_owner_frees():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.incref(ids)
    assert [pool.refcount(i) for i in ids] == [2, 2]
    pool.free(ids)
    assert pool.num_free == 2 and pool.allocate(3) is None
    pool.free(ids)
    assert pool.num_free == 4
    _assert_empty(pool)


def test_double_free_and_incref_of_free_block_are_invariant_violations():
    pool = BlockPool(4)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free(ids)
    with pytest.raises(AssertionError, match="incref of free block 3"):
        pool.incref([3])
    with pytest.raises(AssertionError, match="out of range"):
        pool.free([4])


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="n must be"):
        BlockPool(3).allocate(-1)


def test_free_count_returns_to_total_after_a_storm():
    rng = random.Random(0)
    pool = BlockPool(64)
    owners: list[list[int]] = []
    for _ in range(2000):
        if owners and rng.random() < 0.45:
            pool.free(owners.pop(rng.randrange(len(owners))))
        elif owners and rng.random() < 0.2:
            shared = rng.choice(owners)
            pool.incref(shared)
            owners.append(list(shared))
        else:
            ids = pool.allocate(rng.randint(1, 9))
            if ids is not None:
                assert len(set(ids)) == len(ids) and ids == sorted(ids)
                assert all(pool.refcount(i) == 1 for i in ids)
                owners.append(ids)
        held = {i for ids in owners for i in ids}
        assert pool.num_free == pool.num_total - len(held)
    for ids in owners:
        pool.free(ids)
    _assert_empty(pool)


def test_kv_cache_views_regions_and_strides():
    config = ModelConfig.preset("tiny")  # 2 layers, 2 kv heads, head_dim 16
    cache = KVCache(config, num_blocks=5, block_size=4, dtype=torch.float16, device="cpu")
    assert len(cache.kv_caches) == 2
    k, v = cache.kv_caches[1]
    assert k.shape == v.shape == (6, 2, 4, 16) and k.dtype == torch.float16  # + padding block
    assert cache.padding_block == 5
    assert k.is_contiguous() and v.is_contiguous()
    assert cache.block_stride_bytes == 2 * 4 * 16 * 2
    assert cache.head_stride_bytes == 4 * 16 * 2

    regions = cache.layer_regions()
    layer_bytes = 6 * 2 * 4 * 16 * 2
    for region, (k, v) in zip(regions, cache.kv_caches, strict=True):
        assert (region.k_ptr, region.v_ptr, region.nbytes) == (
            k.data_ptr(),
            v.data_ptr(),
            layer_bytes,
        )
    assert regions[0].k_ptr + layer_bytes == regions[0].v_ptr
    base, nbytes = cache.region()
    assert base == regions[0].k_ptr and nbytes == 2 * 2 * layer_bytes
    assert regions[1].v_ptr + layer_bytes == base + nbytes

    # The strides address what the views hold: block 3, head 1 of layer 1's V.
    v[3, 1] = 7.0
    offset = regions[1].v_ptr + 3 * cache.block_stride_bytes + cache.head_stride_bytes - base
    flat = cache.storage.view(-1)
    run = flat[offset // 2 : offset // 2 + 4 * 16]
    assert bool((run == 7.0).all()) and int((flat != 0).sum()) == 4 * 16


def test_kv_cache_rejects_bad_sizes():
    config = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(config, num_blocks=0, block_size=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="block_size"):
        KVCache(config, num_blocks=4, block_size=0, dtype=torch.float32, device="cpu")


def test_fork_blocks_shares_full_blocks_and_copies_a_partial_last_one():
    config = ModelConfig.preset("tiny")
    cache = KVCache(config, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    pool = BlockPool(6)
    ids = pool.allocate(3)  # 10 tokens: two full blocks, 2 tokens in the third
    cache.storage[:, :, 2] = torch.arange(2 * 2 * 2 * 4 * 16.0).view(2, 2, 2, 4, 16)
    assert fork_blocks(pool, cache, ids, 10, 2) == [[0, 1, 3], [0, 1, 4]]
    assert [pool.refcount(i) for i in range(6)] == [3, 3, 1, 1, 1, 0]
    for copy in (3, 4):
        assert torch.equal(cache.storage[:, :, copy], cache.storage[:, :, 2])
    assert int((cache.storage[:, :, 5] != 0).sum()) == 0  # nothing else written
    last = pool.allocate(1)
    assert fork_blocks(pool, cache, ids, 10, 1) == [None]  # no block free for the copy
    assert fork_blocks(pool, cache, ids, 8, 2) == [[0, 1], [0, 1]]  # full blocks only: shared
    assert [pool.refcount(i) for i in range(6)] == [5, 5, 1, 1, 1, 1]
    for owner in ([0, 1], [0, 1], [0, 1, 3], [0, 1, 4], ids, last):
        pool.free(owner)
    _assert_empty(pool)
