"""CUDA graphs for decode-only steps.

A decode step of a large model is hundreds of small kernel launches; launched one by one from
Python they cost more than the memory traffic they do. Each batch-size bucket's forward is
captured once and replayed with the step's inputs copied into the captured tensors (by the graph
itself: see StepInputs). A batch is padded up to its bucket; padded rows write and read only the
cache's padding block.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32: padding waste stays under ~1/8."""
    sizes = [1, 2, 4, *range(8, 65, 8)]
    sizes += range(96, max_batch + 32, 32)
    return sorted({min(s, max_batch) for s in sizes})


MAX_HOST_BUFFERS = 8
"""Host buffers a bucket's StepInputs holds at most (StepInputs._free_buffer)."""


class StepInputs:
    """One bucket's step inputs in one byte buffer, pinned on the host and mirrored on the device:
    input ids, positions and slots (int64, [3, bucket]), then sequence lengths and each row's
    index among its sequence's rows (int32, [2, bucket]) and block tables (int32, [bucket,
    max_blocks]). A step costs the host its writes into pinned
    memory and one copy of the whole buffer (three separate copies cost more host time than the
    copy itself takes).

    The host writes the next step's inputs while the copies of earlier ones may still wait in
    the device's queue (async scheduling; a proposer's steps drafting ahead, several a step), so
    a buffer is written again only once its last copy has run (an event per buffer): the host
    buffers are used in turn, and one is added while the next in turn still waits (up to
    MAX_HOST_BUFFERS; then the host waits).

    Padded rows (past the step's n sequences) point at the cache's padding block: they write
    and read only there. NOTE: the copy moves the tables' full width every step, bucket x
    max_blocks x 4 bytes: 2 MB for 256 sequences of up to 128k tokens in 64-token blocks, some
    40 us of DMA against a step of many milliseconds at that batch.
    """

    def __init__(
        self, bucket: int, max_blocks: int, padding_block: int, block_size: int, device
    ) -> None:
        self.bucket = bucket
        self._block_size = block_size
        self._pad_slot = padding_block * block_size
        self._padding_block = padding_block
        self._max_blocks = max_blocks
        # Pinned on CUDA, so that the copy is a plain DMA that does not wait for the host.
        self._cuda = torch.device(device).type == "cuda"
        self._buffers = [self._new_buffer() for _ in range(2)]
        self._turn = 0
        self.device = self._buffers[0].tensor.to(device)
        ids_bytes, lens_bytes = 3 * bucket * 8, 2 * bucket * 4
        ids = self.device[:ids_bytes].view(torch.int64).view(3, bucket)
        self.input_ids, self.positions, self.slots = ids[0], ids[1], ids[2]
        lens = self.device[ids_bytes : ids_bytes + lens_bytes].view(torch.int32).view(2, bucket)
        self.seq_lens, self.row_in_seq = lens[0], lens[1]
        self.block_tables = (
            self.device[ids_bytes + lens_bytes :].view(torch.int32).view(bucket, max_blocks)
        )

    def upload(
        self,
        input_ids: Sequence[int] | None,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        row_in_seq: Sequence[int] | None = None,
    ) -> None:
        """Writes a step's inputs into a free host buffer and queues its copy to `device`.
        input_ids None: the caller writes them on the device after the copy. row_in_seq: each
        row's index among its sequence's rows (AttentionMetadata.row_in_seq), else 0."""
        buffer = self._free_buffer()
        ids, lens, tables = buffer.views
        n, bs = len(positions), self._block_size
        if input_ids is not None:
            ids[0, :n] = input_ids
        ids[1, :n] = positions
        ids[2, :n] = [
            t[p // bs] * bs + p % bs for p, t in zip(positions, block_tables, strict=True)
        ]
        lens[0, :n] = ids[1, :n] + 1
        lens[1, :n] = 0 if row_in_seq is None else row_in_seq
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        # Rows this step does not use, padded (the buffer may hold a larger batch's rows).
        ids[:2, n:] = 0
        ids[2, n:] = self._pad_slot
        lens[0, n:] = 1
        lens[1, n:] = 0
        tables[n:, 0] = self._padding_block
        self.device.copy_(buffer.tensor, non_blocking=True)
        if buffer.copied is not None:
            buffer.copied.record()

    def _free_buffer(self) -> _HostBuffer:
        """The next host buffer in turn, once its last copy has run: a new one in its place
        while that copy still waits (up to MAX_HOST_BUFFERS)."""
        self._turn = (self._turn + 1) % len(self._buffers)
        buffer = self._buffers[self._turn]
        if buffer.copied is not None and not buffer.copied.query():
            if len(self._buffers) < MAX_HOST_BUFFERS:
                buffer = self._new_buffer()
                self._buffers.insert(self._turn, buffer)
            else:
                buffer.copied.synchronize()
        return buffer

    def _new_buffer(self) -> _HostBuffer:
        bucket, max_blocks = self.bucket, self._max_blocks
        ids_bytes, lens_bytes = 3 * bucket * 8, 2 * bucket * 4
        size = ids_bytes + lens_bytes + bucket * max_blocks * 4
        tensor = torch.zeros(size, dtype=torch.uint8, pin_memory=self._cuda)
        raw = tensor.numpy()
        ids = raw[:ids_bytes].view(np.int64).reshape(3, bucket)
        lens = raw[ids_bytes : ids_bytes + lens_bytes].view(np.int32).reshape(2, bucket)
        tables = raw[ids_bytes + lens_bytes :].view(np.int32).reshape(bucket, max_blocks)
        ids[2] = self._pad_slot
        lens[0] = 1
        tables[:] = self._padding_block
        copied = torch.cuda.Event() if self._cuda else None
        return _HostBuffer(tensor, (ids, lens, tables), copied)

    def shift(self, n: int, offsets: torch.Tensor) -> None:
        """Moves the first n rows, once copied to the device, `offsets` [n] positions further
        (their lengths and slots with them), there: for rows whose positions follow from
        device values the host has not read (the accepted drafts of a verification)."""
        from engine.triton_step_shift import shift_rows  # Triton: imported where it runs

        assert offsets.shape == (n,)
        shift_rows(
            self.positions, self.seq_lens, self.slots, self.block_tables, offsets, self._block_size
        )


@contextmanager
def _no_collection():
    """Python's garbage collector off: a collection during a capture that frees an earlier
    engine's graphs or events (a test building several) calls what a capture forbids, and
    the capture fails."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _HostBuffer(NamedTuple):
    tensor: torch.Tensor
    views: tuple[np.ndarray, np.ndarray, np.ndarray]
    """ids [3, bucket], lengths and rows' indices [2, bucket], tables [bucket, max_blocks] over
    `tensor`."""
    copied: torch.cuda.Event | None
    """Recorded after the copy of `tensor` was queued (CUDA)."""


HiddenForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
"""(input ids, positions, meta, previous hidden states) -> (hidden states, float32 logits)."""


class GraphStep(NamedTuple):
    """A replay's outputs for its n rows (views of the graph's buffers: valid until the next
    replay of the same bucket)."""

    logits: torch.Tensor
    """[n, vocab] float32."""
    greedy: torch.Tensor
    """[n] int64: the logits' argmax, computed inside the graph."""
    hidden: torch.Tensor
    """[n, width]: what a proposer fed hidden states reads (CausalLM.proposer_hidden: the
    model's output after its final norm for an MTP layer, aux layers' streams for EAGLE-3)."""


class DecodeGraphs:
    """One graph per batch bucket of decode rows. With `new_kv_first`, rows may be consecutive
    tokens of one sequence (speculative verification, a draft model's catch-up): each row is
    given its own position and its sequence's block table, and every row's K/V is written
    before any row attends (AttentionMetadata.new_kv_first). With `max_rows_per_seq` > 1 the
    rows of one sequence, up to that many, are told apart by `run`'s row_in_seq, and attention
    reads their context once for all of them (AttentionMetadata.row_in_seq).

    `forward` replaces the model's forward and logits, for a module that also takes a hidden
    state per row (an MTP layer, engine.mtp): (ids, positions, meta, previous [rows, width])
    -> (hidden, logits); `run` copies its `previous` into a buffer of `previous_width`."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        max_batch: int,
        max_model_len: int,
        new_kv_first: bool = False,
        forward: HiddenForward | None = None,
        previous_width: int = 0,
        max_rows_per_seq: int = 1,
    ) -> None:
        assert new_kv_first or max_rows_per_seq == 1
        self.model = model
        self.new_kv_first = new_kv_first
        self.max_rows_per_seq = max_rows_per_seq
        self._forward = forward
        self.kv_cache = kv_cache
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        device = kv_cache.storage.device
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self._inputs = {
            bucket: StepInputs(
                bucket, max_blocks, kv_cache.padding_block, kv_cache.block_size, device
            )
            for bucket in self.buckets
        }
        self._query_start = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self._previous = torch.zeros(
            self.max_batch, previous_width, dtype=kv_cache.storage.dtype, device=device
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._greedy: dict[int, torch.Tensor] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._capture_all(max_model_len)

    def run(
        self,
        input_ids: Sequence[int] | None,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        fed_ids: torch.Tensor | None = None,
        previous: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        row_in_seq: Sequence[int] | None = None,
    ) -> GraphStep:
        """The outputs of one decode token per row (n <= max_batch rows). The input ids are
        `input_ids` from the host, or `fed_ids` [n], already on the device; `previous` [n,
        previous_width]: the rows' hidden inputs, for a `forward` that takes them; `offsets`
        [n] on the device: added to `positions` (StepInputs.shift); `row_in_seq` [n]: each
        row's index among its sequence's rows, for graphs of max_rows_per_seq > 1."""
        n = len(positions)
        bucket = next(b for b in self.buckets if b >= n)
        inputs = self._inputs[bucket]
        inputs.upload(input_ids, positions, block_tables, row_in_seq)
        if offsets is not None:
            inputs.shift(n, offsets)
        if fed_ids is not None:
            inputs.input_ids[:n].copy_(fed_ids)
        if previous is not None:
            self._previous[:n].copy_(previous)
        self._graphs[bucket].replay()
        logits, greedy, hidden = self._logits[bucket], self._greedy[bucket], self._hidden[bucket]
        return GraphStep(logits[:n], greedy[:n], hidden[:n])

    def _capture_all(self, max_model_len: int) -> None:
        from engine.triton_ops import greedy_tokens  # Triton: imported on CUDA only

        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs reuse the largest one's memory from the shared pool.
        for bucket in reversed(self.buckets):
            inputs = self._inputs[bucket]
            meta = AttentionMetadata(
                slot_mapping=inputs.slots,
                query_start_loc=self._query_start[: bucket + 1],
                seq_lens=inputs.seq_lens,
                block_tables=inputs.block_tables,
                max_query_len=1,
                max_seq_len=max_model_len,
                new_kv_first=self.new_kv_first,
                row_in_seq=inputs.row_in_seq if self.max_rows_per_seq > 1 else None,
                max_rows_per_seq=self.max_rows_per_seq,
            )
            # Padded rows only until the first write: everything points at the padding block.
            args = (inputs.input_ids, inputs.positions, meta, self._previous[:bucket])
            # Warm-up: compiles kernels, sets up cuBLAS, outside the capture.
            greedy_tokens(self._hidden_and_logits(*args)[1])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # lm_head inside the graph: one replay per step, no GEMM and cast launched apart.
            with torch.cuda.graph(graph, pool=pool), _no_collection():
                self._hidden[bucket], self._logits[bucket] = self._hidden_and_logits(*args)
                self._greedy[bucket] = greedy_tokens(self._logits[bucket])
            self._graphs[bucket] = graph
        torch.cuda.synchronize()

    def _hidden_and_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        previous: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._forward is not None:
            return self._forward(input_ids, positions, meta, previous)
        hidden = self.model(input_ids, positions, self.kv_cache.kv_caches, meta)
        return self.model.proposer_hidden(hidden), self.model.compute_logits(hidden)
