"""The paged KV cache's memory and the pool that hands out its blocks.

A block's life: free in the pool -> `allocate` gives it to one owner (refcount 1) -> `incref` for
each further owner that shares it -> `free` by every owner; at refcount 0 it is free again.
The pool knows nothing of sequences or tensors; the cache knows nothing of owners. `fork_blocks`
uses both to give more owners the KV of a run of tokens: they share its full blocks and each
gets a copy of a partial last one, which its owner goes on writing into.
"""

import bisect
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import ModelConfig
from engine.host_values import to_device


@dataclass(frozen=True)
class LayerRegion:
    """One layer's planes as raw memory, for the transport to register and address."""

    k_ptr: int  # address of K [num_blocks, num_kv_heads, block_size, head_dim], or of the latent
    v_ptr: int | None  # address of V, K's shape; None in an "mla-latent" cache (one plane)
    nbytes: int  # size of each plane


class KVCache:
    """Per layer the planes of the model's `kv_format`, each [num_blocks + 1, heads, block_size,
    channels]: K and V of [.., num_kv_heads, .., head_dim] ("hnd"), or one MLA latent plane of
    [.., 1, .., kv_lora_rank + qk_rope_head_dim] ("mla-latent"). The last block is
    `padding_block`."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        """Blocks a pool hands out: ids [0, num_blocks)."""
        self.padding_block = num_blocks
        """One extra block past the pool's: the padded rows of a CUDA-graph batch write and read
        here, so they can never touch a live sequence's KV."""
        self.block_size = block_size
        self.dtype = dtype
        self.kv_format = config.kv_format
        planes, heads, channels = config.kv_planes
        # One allocation for all layers, [layer, plane, block, head, slot, dim]: a transport
        # registers (and an RDMA NIC pins) one region instead of one per plane and layer, and
        # each layer's planes are still contiguous views. Zeroed so that a fresh cache reads the
        # same everywhere (checksums, dumps), not whatever the allocator left.
        shape = (config.num_layers, planes, num_blocks + 1, heads, block_size, channels)
        self.storage = _zeros_that_fit(shape, dtype, torch.device(device))
        # The model's `kv_caches` argument: per layer a tuple of its planes, (K, V) or
        # (latent,). Indexed, not iterated: iterating unbinds into views that autograd forbids
        # writing in place.
        self.kv_caches = [
            tuple(self.storage[i, p] for p in range(planes)) for i in range(config.num_layers)
        ]

    @property
    def block_stride_bytes(self) -> int:
        """Bytes from one block to the next within a layer's plane (K, V or latent)."""
        return self.storage.stride(2) * self.storage.element_size()

    @property
    def head_stride_bytes(self) -> int:
        """Bytes from one head to the next within a block: one contiguous run per head."""
        return self.storage.stride(3) * self.storage.element_size()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copies block src[i] into block dst[i], every layer's planes, on the cache's device (in
        stream order with the forwards). dst's ids must be distinct."""
        assert len(src) == len(dst), (src, dst)
        if not dst:
            return
        device = self.storage.device
        src_ids = to_device(src, device, torch.long)
        dst_ids = to_device(dst, device, torch.long)
        # One gather and one scatter over [layer, plane, block, ...]: the block dim is 2.
        self.storage[:, :, dst_ids] = self.storage[:, :, src_ids]

    def region(self) -> tuple[int, int]:
        """(address, nbytes) of the whole cache, every layer's planes inside it."""
        return self.storage.data_ptr(), self.storage.numel() * self.storage.element_size()

    def layer_regions(self) -> list[LayerRegion]:
        """Where each layer's planes live, in layer order: K and V, or the latent as `k_ptr`."""
        regions = []
        for first, *rest in self.kv_caches:
            v_ptr = rest[0].data_ptr() if rest else None
            nbytes = first.numel() * first.element_size()
            regions.append(LayerRegion(k_ptr=first.data_ptr(), v_ptr=v_ptr, nbytes=nbytes))
        return regions


class BlockPool:
    """Reference-counted allocator of block ids [0, num_blocks).

    Free ids are kept as maximal runs of consecutive ids so that allocations come out as
    contiguous ranges whenever one fits: the transport moves a run of adjacent blocks as one
    descriptor, and descriptor count, not bytes, bounds transfer time.

    Free blocks that hold KV a prefix cache may still reuse (named: engine/prefix_cache.py)
    are kept apart, least recently freed first, and handed out only when the runs cannot serve
    an allocation, the oldest first.

    Thread-safe: the decode server reserves blocks for incoming KV from its RPC threads while
    the engine's thread allocates and frees them for running sequences.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self._refs = [0] * num_blocks
        self._num_free = num_blocks
        self._starts = [0]  # sorted start ids of the free runs
        self._run_len = {0: num_blocks}  # run start -> run length
        self._run_at_end = {num_blocks: 0}  # run end (exclusive) -> run start, for merging
        self._lock = threading.Lock()
        # Prefix caching (engine/prefix_cache.py): blocks named by their KV's tokens, found by
        # `lookup` until `allocate` hands them out again (a free one keeps its KV till then).
        self._named: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Free named blocks, outside the runs, least recently freed first."""

    @property
    def num_total(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return self._num_free

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """n block ids in ascending order, each with refcount 1; None if fewer than n are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            return self._allocate(n)

    def _allocate(self, n: int) -> list[int] | None:
        if n > self._num_free:
            return None
        from_runs = min(n, self._num_free - len(self._cached))
        ids = self._take_runs(from_runs)
        for _ in range(n - from_runs):  # the least recently freed named blocks, forgotten
            block_id, _ = self._cached.popitem(last=False)
            del self._named[self._name_of.pop(block_id)]
            ids.append(block_id)
        ids.sort()
        for block_id in ids:
            self._refs[block_id] = 1
        self._num_free -= n
        return ids

    def _take_runs(self, n: int) -> list[int]:
        """n ids out of the free runs (which hold at least n), ascending."""
        # First fit: the lowest run long enough gives one contiguous range.
        start = next((s for s in self._starts if self._run_len[s] >= n), None)
        if start is not None:
            ids = list(range(start, start + n))
            self._take(start, n)
        else:
            # Fragmented: longest runs first, so the allocation comes in the fewest pieces.
            ids = []
            for start in sorted(self._starts, key=lambda s: (-self._run_len[s], s)):
                count = min(self._run_len[start], n - len(ids))
                ids.extend(range(start, start + count))
                self._take(start, count)
                if len(ids) == n:
                    break
            ids.sort()
        return ids

    def name(self, block_id: int, name: bytes) -> None:
        """Names an allocated block by the tokens its KV holds (engine/prefix_cache.py):
        `lookup` finds it by that name until `allocate` hands it out again, after its owners
        have freed it. A name another block holds already stays that block's."""
        with self._lock:
            assert self._refs[block_id] > 0, f"naming free block {block_id}"
            if name not in self._named and block_id not in self._name_of:
                self._named[name] = block_id
                self._name_of[block_id] = name

    def lookup(self, names: Iterable[bytes]) -> list[int]:
        """The blocks named by the longest run of `names` from the first, each with one more
        owner (a free one taken out of the free runs, its KV intact)."""
        with self._lock:
            ids = []
            for name in names:
                block_id = self._named.get(name)
                if block_id is None:
                    break
                ids.append(block_id)
            for block_id in ids:
                if self._refs[block_id] == 0:
                    del self._cached[block_id]
                    self._num_free -= 1
                self._refs[block_id] += 1
            return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Adds an owner to each of ids, which must be allocated."""
        with self._lock:
            for block_id in ids:
                assert 0 <= block_id < len(self._refs), f"block id {block_id} out of range"
                assert self._refs[block_id] > 0, f"incref of free block {block_id}"
                self._refs[block_id] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drops one owner of each of ids; a block with no owner left returns to the pool."""
        with self._lock:
            for block_id in ids:
                assert 0 <= block_id < len(self._refs), f"block id {block_id} out of range"
                assert self._refs[block_id] > 0, f"double free of block {block_id}"
                self._refs[block_id] -= 1
                if self._refs[block_id] == 0:
                    if block_id in self._name_of:  # its KV may serve again: kept apart
                        self._cached[block_id] = None
                    else:
                        self._release(block_id)
                    self._num_free += 1

    def _take(self, start: int, count: int) -> None:
        """Removes the first count ids of the free run beginning at start."""
        length = self._run_len.pop(start)
        end = start + length
        index = bisect.bisect_left(self._starts, start)
        if count == length:
            del self._starts[index]
            del self._run_at_end[end]
        else:
            self._starts[index] = start + count  # still sorted: it stays below the next run
            self._run_len[start + count] = length - count
            self._run_at_end[end] = start + count

    def _release(self, block_id: int) -> None:
        """Puts block_id back, merged with the free runs that end right before or start after."""
        start = self._run_at_end.pop(block_id, None)
        if start is None:
            start, length = block_id, 1
            bisect.insort(self._starts, block_id)
        else:
            length = self._run_len[start] + 1
        right_len = self._run_len.pop(block_id + 1, None)
        if right_len is not None:
            length += right_len
            del self._run_at_end[block_id + 1 + right_len]
            del self._starts[bisect.bisect_left(self._starts, block_id + 1)]
        self._run_len[start] = length
        self._run_at_end[start + length] = start


class BlockCopier(Protocol):
    """A cache's block size and block copies: a KVCache, or an engine's StepExecutor (which
    copies on every tensor-parallel rank)."""

    block_size: int

    def copy_blocks(self, src: list[int], dst: list[int]) -> None: ...


def fork_blocks(
    pool: BlockPool, cache: BlockCopier, block_ids: list[int], num_tokens: int, count: int
) -> list[list[int] | None]:
    """`count` block lists, each holding the KV of tokens [0, num_tokens) of `block_ids`: their
    full blocks shared (one more reference each), a partial last block copied into a block of
    the list's own. None for each list that found no free block for its copy."""
    full, partial = divmod(num_tokens, cache.block_size)
    assert len(block_ids) * cache.block_size >= num_tokens, (block_ids, num_tokens)
    shared = block_ids[:full]
    forks: list[list[int] | None] = []
    copies: list[int] = []
    for _ in range(count):
        own = pool.allocate(1) if partial else []
        if own is None:
            forks.append(None)
            continue
        pool.incref(shared)
        copies += own
        forks.append(shared + own)
    if copies:
        cache.copy_blocks([block_ids[full]] * len(copies), copies)
    return forks


def _zeros_that_fit(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """torch.zeros(shape), or a ValueError naming the fix where it does not fit in the memory
    free: checked first (on the CPU an allocation past it succeeds, and the process is killed
    later, when the zeros touch its pages), and the allocation's own failure too."""
    nbytes = math.prod(shape) * dtype.itemsize
    free = _free_bytes(device)
    if free is None or nbytes <= free:
        try:
            return torch.zeros(shape, dtype=dtype, device=device)
        except torch.OutOfMemoryError:  # taken meanwhile, or fragmented
            free = _free_bytes(device)
    place = "the host" if device.type == "cpu" else str(device)
    raise ValueError(
        f"kv_cache_gb: the KV cache needs {nbytes / 2**30:.2f} GiB; {place} has "
        f"{(free or 0) / 2**30:.2f} GiB free after the weights; fix: lower --kv-cache-gb"
    )


def _free_bytes(device: torch.device) -> int | None:
    """Memory an allocation on `device` can have: the GPU's free memory and what torch's
    allocator holds unused; the host's MemAvailable. None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
