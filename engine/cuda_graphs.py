"""CUDA graphs for decode-only steps.

A decode step of a large model is hundreds of small kernel launches; launched one by one from
Python they cost more than the memory traffic they do. Each batch-size bucket's forward is
captured once and replayed with the step's inputs copied into the captured tensors. A batch is
padded up to its bucket; padded rows write and read only the cache's padding block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: padding waste stays under ~1/8."""
    sizes = [1, 2, 4, *range(8, 65, 8)]
    sizes += range(96, max_batch + 32, 32)
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache, max_batch: int, max_model_len: int
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        device = kv_cache.storage.device
        self._block_size = kv_cache.block_size
        max_blocks = -(-max_model_len // self._block_size)
        pad = kv_cache.padding_block
        # Host staging (pinned, so the copies below are asynchronous) and the captured tensors.
        self._host_ids = torch.zeros(3, self.max_batch, dtype=torch.int64, pin_memory=True)
        self._host_lens = torch.ones(self.max_batch, dtype=torch.int32, pin_memory=True)
        self._host_tables = torch.full(
            (self.max_batch, max_blocks), pad, dtype=torch.int32, pin_memory=True
        )
        self._ids = self._host_ids.to(device)  # rows: input ids, positions, slots
        self._lens = self._host_lens.to(device)
        self._tables = self._host_tables.to(device)
        self._query_start = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._capture_all(max_model_len)

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Logits [n, vocab] (float32) of one decode token per sequence (n <= max_batch)."""
        n = len(input_ids)
        bucket = next(b for b in self.buckets if b >= n)
        ids = self._host_ids.numpy()
        tables = self._host_tables.numpy()
        lens = self._host_lens.numpy()
        bs = self._block_size
        pad_slot = self.kv_cache.padding_block * bs
        ids[0, :n] = input_ids
        ids[1, :n] = positions
        for i, (pos, table) in enumerate(zip(positions, block_tables, strict=True)):
            ids[2, i] = table[pos // bs] * bs + pos % bs
            tables[i, : len(table)] = table
        ids[:, n:bucket] = 0
        ids[2, n:bucket] = pad_slot
        lens[:n] = [p + 1 for p in positions]
        lens[n:bucket] = 1
        tables[n:bucket, 0] = self.kv_cache.padding_block
        width = max(len(t) for t in block_tables)
        self._ids[:, :bucket].copy_(self._host_ids[:, :bucket], non_blocking=True)
        self._lens[:bucket].copy_(self._host_lens[:bucket], non_blocking=True)
        self._tables[:bucket, :width].copy_(self._host_tables[:bucket, :width], non_blocking=True)
        self._graphs[bucket].replay()
        return self._logits[bucket][:n]

    def _capture_all(self, max_model_len: int) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs reuse the largest one's memory from the shared pool.
        for bucket in reversed(self.buckets):
            meta = AttentionMetadata(
                slot_mapping=self._ids[2, :bucket],
                query_start_loc=self._query_start[: bucket + 1],
                seq_lens=self._lens[:bucket],
                block_tables=self._tables[:bucket],
                max_query_len=1,
                max_seq_len=max_model_len,
            )
            args = (self._ids[0, :bucket], self._ids[1, :bucket], self.kv_cache.kv_caches, meta)
            # Padded rows only: slots, positions and lengths all point at the padding block.
            self._ids[2, :bucket] = self.kv_cache.padding_block * self._block_size
            # Warm-up: compiles kernels, sets up cuBLAS, outside the capture.
            self.model.compute_logits(self.model(*args))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # lm_head inside the graph: one replay per step, no GEMM and cast launched apart.
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bucket] = self.model.compute_logits(self.model(*args))
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
