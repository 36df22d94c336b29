"""Runs one StepPlan: packs the scheduled tokens, runs the model, samples the next tokens."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampling import Sampler
from engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.storage.device

    def run(self, plan: StepPlan) -> dict[str, int]:
        """One forward over the plan; returns {seq_id: sampled token} for sequences that sample."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        last_rows: list[int] = []
        sampling = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.seq.num_computed, item.num_new_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
            if item.samples:
                last_rows.append(len(input_ids) - 1)
                sampling.append(item)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, tables, self.kv_cache.block_size, self.device
        )
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_cache.kv_caches,
            meta,
        )
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
        tokens = self.sampler(logits, [item.seq.sampling_row() for item in sampling]).tolist()
        return {item.seq.seq_id: token for item, token in zip(sampling, tokens, strict=True)}
