"""Runs one StepPlan: packs the scheduled tokens, runs the model, samples the next tokens.

Decode-only steps on CUDA replay a captured graph (engine/cuda_graphs.py); everything else
(prefill chunks, mixed batches, CPU) runs the model eagerly.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampling import Sampler
from engine.scheduler import StepPlan


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        sampler: Sampler,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.graphs = graphs
        self.device = kv_cache.storage.device

    def run(self, plan: StepPlan) -> dict[str, int]:
        """One forward over the plan; returns {seq_id: sampled token} for sequences that sample."""
        sampling = [item for item in plan.scheduled if item.samples]
        greedy = None
        if self.graphs is not None and plan.is_decode_only:
            logits, greedy = self._decode_with_graph(plan)
        else:
            hidden, last_rows = self._forward_eager(plan)
            if not sampling:
                return {}
            hidden = hidden[torch.tensor(last_rows, device=self.device)]
            logits = self.model.compute_logits(hidden)
        rows = [item.seq.sampling_row() for item in sampling]
        if greedy is not None and all(r.params.greedy and not r.params.penalized for r in rows):
            tokens = greedy.tolist()  # the graph's own argmax: nothing more to launch
        else:
            tokens = self.sampler(logits, rows).tolist()
        return {item.seq.seq_id: token for item, token in zip(sampling, tokens, strict=True)}

    def _decode_with_graph(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of every scheduled sequence: each feeds its last token, so
        every row samples."""
        seqs = [item.seq for item in plan.scheduled]
        # The graphs are captured up to the scheduler's max_num_seqs.
        assert len(seqs) <= self.graphs.max_batch
        positions = [seq.num_computed for seq in seqs]
        input_ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions, strict=True)]
        return self.graphs.run(input_ids, positions, [seq.block_ids for seq in seqs])

    def _forward_eager(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        last_rows: list[int] = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.seq.num_computed, item.num_new_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
            if item.samples:
                last_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, tables, self.kv_cache.block_size, self.device
        )
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_cache.kv_caches,
            meta,
        )
        return hidden, last_rows
