"""The draft-model proposer: a smaller model of the target's vocabulary guesses the next tokens.

The draft has a paged KV cache of its own with as many blocks as the target's, addressed by the
same block ids: a sequence's blocks hold its draft KV at the same slots as its target KV, so the
scheduler's allocation (draft room included) serves both, and preemption or completion frees
both. `Sequence.num_draft_computed` counts the tokens whose draft KV is in place.

A proposal for sequences of N tokens: one forward feeds each sequence's tokens the draft has not
seen (the whole prompt the first time, in chunks, unless a prefill sent the draft's prompt KV
with the model's: `fill_prompt` on the prefill's side; after a step, its accepted drafts and the
target's token) and takes the argmax after the last; then k - 1 one-token forwards each feed the
previous guess (replayed CUDA graphs on the GPU). The draft KV of the guesses is not kept: what
was accepted is fed again with the next catch-up, inside a forward that runs anyway.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.host_values import to_device
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sequence import Sequence
from engine.speculative import chain_drafts


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        max_chunk: int,
        graphs: DecodeGraphs | None = None,
        catch_up_graphs: DecodeGraphs | None = None,
    ) -> None:
        """`graphs`: one-token steps; `catch_up_graphs` (new_kv_first): catch-ups of up to its
        max_batch tokens in all, a row per token (the prompt's first catch-up runs eagerly)."""
        self.model = model
        self.kv_cache = kv_cache
        self.max_chunk = max_chunk
        """Tokens one sequence feeds in one catch-up forward at most (the engine's
        max_num_batched_tokens)."""
        self.graphs = graphs
        self.catch_up_graphs = catch_up_graphs
        self.device = kv_cache.storage.device

    def propose(self, seqs: Seq[Sequence], rooms: Seq[int]) -> list[list[int]]:
        active = [(seq, room) for seq, room in zip(seqs, rooms, strict=True) if room > 0]
        if not active:
            return [[] for _ in seqs]
        self._feed([seq for seq, _ in active], leave=self.max_chunk)
        fed = [(seq, seq.num_tokens - seq.num_draft_computed) for seq, _ in active]
        guesses = self._forward(fed).argmax(dim=-1)
        for seq, _ in active:
            seq.num_draft_computed = seq.num_tokens

        def step(j: int, rows: list[int], index: torch.Tensor, previous: torch.Tensor):
            # Guess j's input, guess j - 1, at position N - 1 + j.
            riding = [active[i][0] for i in rows]
            return self._step(previous, [seq.num_tokens - 1 + j for seq in riding], riding)

        return chain_drafts(seqs, active, guesses, step)

    def fill_prompt(self, seqs: Seq[Sequence]) -> None:
        self._feed(list(seqs), leave=1)

    def _feed(self, seqs: list[Sequence], leave: int) -> None:
        """Feeds each sequence's unseen tokens, in chunks of max_chunk, until `leave` of them
        remain unseen (a proposal's forward feeds those and takes its logits)."""
        while True:
            behind = [
                (seq, min(self.max_chunk, unseen - leave))
                for seq in seqs
                if (unseen := seq.num_tokens - seq.num_draft_computed) > leave
            ]
            if not behind:
                return
            self._forward(behind, logits=False)
            for seq, n in behind:
                seq.num_draft_computed += n

    def _forward(self, fed: list[tuple[Sequence, int]], logits: bool = True) -> torch.Tensor:
        """Feeds each sequence's next n unseen tokens; logits after each one's last."""
        graphs = self.catch_up_graphs
        if logits and graphs is not None and sum(n for _, n in fed) <= graphs.max_batch:
            return self._catch_up_in_graph(fed)
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, n in fed:
            start = seq.num_draft_computed
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_ids)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, tables, self.kv_cache.block_size, self.device
        )
        hidden = self.model(
            to_device(ids, self.device),
            to_device(positions, self.device),
            self.kv_cache.kv_caches,
            meta,
        )
        if not logits:
            return hidden
        last = to_device(meta.host_query_start_loc[1:], self.device) - 1
        return self.model.compute_logits(hidden[last])

    def _catch_up_in_graph(self, fed: list[tuple[Sequence, int]]) -> torch.Tensor:
        ids, positions, tables, last_rows = [], [], [], []
        for seq, n in fed:
            start = seq.num_draft_computed
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            tables.extend([seq.block_ids] * n)
            last_rows.append(len(ids) - 1)
        logits = self.catch_up_graphs.run(ids, positions, tables).logits
        return logits[to_device(last_rows, self.device)]

    def _step(
        self, tokens: torch.Tensor, positions: list[int], seqs: list[Sequence]
    ) -> torch.Tensor:
        """Greedy guesses after feeding `tokens` [B] (on the device) at `positions`."""
        tables = [seq.block_ids for seq in seqs]
        if self.graphs is not None and len(seqs) <= self.graphs.max_batch:
            return self.graphs.run(None, positions, tables, fed_ids=tokens).greedy
        lens = [p + 1 for p in positions]
        meta = AttentionMetadata.build(
            [1] * len(seqs), lens, tables, self.kv_cache.block_size, self.device
        )
        hidden = self.model(
            tokens, to_device(positions, self.device), self.kv_cache.kv_caches, meta
        )
        return self.model.compute_logits(hidden).argmax(dim=-1)
