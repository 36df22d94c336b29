"""The device work of a step, asked for with plain arguments (token ids, positions, block tables):
the model's forward over packed tokens, the logits of some of its output rows, a CUDA-graph
replay, a copy of KV blocks.

On one device the runner calls a StepExecutor directly. Under tensor parallelism every rank holds
one over its own part of the model and cache, and rank 0's (engine/tp_workers.py) sends each
call to the other ranks before making it: every rank runs the same calls in the same order, so
their collectives meet. Arguments are therefore host values (lists), never device tensors,
except the fed ids of a step planned ahead, which only one device runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs, GraphStep
from engine.host_values import to_device
from engine.kv_cache import KVCache
from engine.model import CausalLM


class StepExecutor:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        graphs: DecodeGraphs | None = None,
        verify_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.graphs = graphs
        """Decode steps, a row per sequence."""
        self.verify_graphs = verify_graphs
        """Decode steps that feed drafts, a row per fed token."""
        self.device = kv_cache.storage.device
        self._hidden: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def forward(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the packed tokens: each sequence's query_lens[i]
        tokens, ending at seq_lens[i]; kept for `logits`."""
        meta = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.kv_cache.block_size, self.device
        )
        ids = input_ids
        if not isinstance(ids, torch.Tensor):
            ids = to_device(ids, self.device)
        self._hidden = self.model(
            ids, to_device(positions, self.device), self.kv_cache.kv_caches, meta
        )
        return self._hidden

    def logits(self, rows: Sequence[int]) -> torch.Tensor:
        """Float32 logits of rows of the last forward's hidden states."""
        assert self._hidden is not None, "logits before a forward"
        return self.model.compute_logits(self._hidden[to_device(rows, self.device)])

    def replay(
        self,
        verify: bool,
        input_ids: Sequence[int] | None,
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        row_in_seq: Sequence[int] | None = None,
        fed_ids: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> GraphStep:
        """A replay of the decode graphs (`verify`: the verification graphs), DecodeGraphs.run."""
        graphs = self.verify_graphs if verify else self.graphs
        return graphs.run(
            input_ids, positions, block_tables, fed_ids=fed_ids, offsets=offsets,
            row_in_seq=row_in_seq,
        )  # fmt: skip

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.kv_cache.copy_blocks(src, dst)
