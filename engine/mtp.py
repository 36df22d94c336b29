"""Multi-token prediction (DeepSeek-V3, GLM-5): the model's own MTP layer proposes drafts.

An MTP layer (checkpoint layer num_layers + i) predicts the token after next: at position j it
takes the target's hidden state h_j (its output after the final norm) and the embedding of
token j + 1 (zeroed at position 0), normalizes each (enorm, hnorm), projects their
concatenation (eh_proj) to the model's width, runs one decoder layer of the model's kind (MLA
attention over a latent cache of its own, and the MoE MLP), and gives its hidden state g_j
(before the shared head's norm) and logits over the vocabulary (shared_head.norm, then
shared_head.head). Deeper drafts chain the layer on itself: draft d + 1 comes from g of draft
d's position and draft d's token, layer d mod num_mtp_layers. The embedding is the target's
(DeepSeek-V3's checkpoints store an identical copy with the layer, not loaded).

`MtpProposer` keeps, per sequence, the target's hidden states of the positions its MTP cache
lacks (`Sequence.draft_hidden`, recorded after every target step: the prompt's, then the
positions the target accepted) and `Sequence.num_draft_computed`; a proposal first feeds those
positions (one forward), whose last row gives draft 1, then one row per further draft. Every
forward lays its tokens out a row each, with its own position and its sequence's block table
(AttentionMetadata.new_kv_first), so that steps of up to MAX_GRAPH_ROWS rows replay CUDA graphs
(engine.cuda_graphs, the layer's `predict` captured). The MTP cache's blocks are the target's,
as a draft model's are (engine/draft_proposer.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import torch

from engine import mla as torch_mla
from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from engine.kv_cache import KVCache
from engine.mla import LatentBackend
from engine.model import EAGER_OPS, Linear, ModelOps, RMSNorm
from engine.moe import TORCH_KERNELS, MoeKernels
from engine.scheduler import StepPlan
from engine.sequence import Sequence
from engine.speculative import chain_drafts


class SharedHead(torch.nn.Module):
    def __init__(self, config: ModelConfig, ops: ModelOps) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.head = Linear(config.hidden_size, config.vocab_size, False, ops)


class MtpLayer(DeepseekDecoderLayer):
    """One MTP layer: a decoder layer of the model (its parameters under the checkpoint's names,
    relative to `model.layers.<num_layers + index>.`) with enorm, hnorm, eh_proj and
    shared_head around it."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        ops: ModelOps = EAGER_OPS,
        latent: LatentBackend = torch_mla,
        experts: MoeKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(config, config.num_layers + index, ops, latent, experts)
        self.config = config
        self.layer_index = config.num_layers + index
        self.ops = ops
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, ops)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, ops)
        self.eh_proj = Linear(2 * hidden, hidden, False, ops)
        self.shared_head = SharedHead(config, ops)

    def init_buffers(self) -> None:
        """Nothing of its own: RoPE is the target's (engine.weights calls this after filling)."""

    @torch.inference_mode()
    def predict(
        self,
        target: DeepseekForCausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, hidden], logits [T, vocab] float32) for tokens `input_ids` at `positions`,
        each with the hidden state before it (the target's, or g of the draft before).
        `logit_rows`: the logits of these rows only (a whole prompt's would not fit)."""
        embedded = target.model.embed_tokens(input_ids)
        embedded = torch.where((positions == 0)[:, None], 0.0, embedded).to(embedded.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        cos, sin = target.model.rotary_emb(positions, x.dtype)
        inp = self.forward(
            self.input_layernorm.input_of(x), cos, sin, kv_cache, meta, self.shared_head.norm
        )
        normed, g = inp.compute(self.ops)
        if logit_rows is not None:
            normed = normed[logit_rows]
        return g, self.ops.linear(normed, self.shared_head.head.matrix, None).float()


class MtpProposer:
    kv_cache: KVCache

    def __init__(
        self,
        layers: list[MtpLayer],
        target: DeepseekForCausalLM,
        kv_cache: KVCache,
        max_chunk: int,
        graphs: list[DecodeGraphs] | None = None,
    ) -> None:
        """`max_chunk`: rows of one sequence a catch-up forward feeds at most (the engine's
        max_num_batched_tokens); `graphs`: one per layer (new_kv_first, its `forward` the
        layer's `predict`), for steps of up to their max_batch rows; the rest runs eagerly."""
        self.layers = layers
        self.max_chunk = max_chunk
        self.target = target
        self.kv_cache = kv_cache
        self.graphs = graphs
        self.device = kv_cache.storage.device

    def record(self, plan: StepPlan, hidden: torch.Tensor | None, accepted: dict[str, int]) -> None:
        """Keeps the target's hidden states of the positions a finished step settled: every fed
        one, or of a sequence that fed drafts its last token's and the accepted drafts'. Those
        of a sequence the step finished too: a prefill fills the MTP cache of its prompt after
        its first token (`fill_prompt`)."""
        if hidden is None:
            return
        row = 0
        for item in plan.scheduled:
            seq, fed = item.seq, item.num_new_tokens
            keep = 1 + accepted[seq.seq_id] if item.draft else fed
            pending = seq.draft_hidden
            have = seq.num_draft_computed + (0 if pending is None else len(pending))
            if have == item.start:
                rows = hidden[row : row + keep]
                seq.draft_hidden = rows.clone() if pending is None else torch.cat([pending, rows])
            row += fed

    def propose(self, seqs: Seq[Sequence], rooms: Seq[int]) -> list[list[int]]:
        """Drafts for the sequences whose hidden states reach their last token (one admitted
        with its prompt's KV gets none at its first step, whose hidden state it waits for)."""
        active = [
            (seq, room) for seq, room in zip(seqs, rooms, strict=True) if room > 0 and _covered(seq)
        ]
        if not active:
            return [[] for _ in seqs]
        g, guesses = self._catch_up([seq for seq, _ in active])

        def step(j: int, rows: list[int], index: torch.Tensor, previous: torch.Tensor):
            # Draft j - 1 at position N - 2 + j, after g of the position before.
            nonlocal g
            riding = [active[i][0] for i in rows]
            positions = [seq.num_tokens - 2 + j for seq in riding]
            tables = [seq.block_ids for seq in riding]
            g_rows, guesses = self._rows(j, previous, positions, tables, g[index])
            g = g.clone()  # g_rows may be a graph's buffer, which the next replay overwrites
            g[index] = g_rows
            return guesses

        return chain_drafts(seqs, active, guesses, step)

    def fill_prompt(self, seqs: Seq[Sequence]) -> None:
        """The MTP cache of positions 0 .. N - 2 of each sequence of N tokens (its prompt and
        first token, on a prefill): the catch-up a first proposal would run."""
        missing = [seq.seq_id for seq in seqs if not _covered(seq)]
        assert not missing, f"no hidden states kept for {missing}"
        if seqs:
            self._catch_up(list(seqs), logits=False)

    def _catch_up(
        self, seqs: list[Sequence], logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds each sequence's pending positions (j with token j + 1, h_j), a row each, at
        most max_chunk rows of a sequence a forward (a whole prompt's would not fit): g and the
        greedy draft 1 after each one's last (`logits`: else no draft)."""
        while behind := [seq for seq in seqs if len(seq.draft_hidden) > self.max_chunk]:
            self._feed(behind, self.max_chunk, logits=False)
        return self._feed(seqs, None, logits)

    def _feed(
        self, seqs: list[Sequence], limit: int | None, logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `limit` (None: all) pending positions of each sequence."""
        counts = [len(seq.draft_hidden) if limit is None else limit for seq in seqs]
        ids, positions, tables, last = [], [], [], []
        for seq, count in zip(seqs, counts, strict=True):
            start = seq.num_draft_computed
            ids.extend(seq.token_ids[start + 1 : start + count + 1])
            positions.extend(range(start, start + count))
            tables.extend([seq.block_ids] * count)
            last.append(len(ids) - 1)
        previous = torch.cat([seq.draft_hidden[:n] for seq, n in zip(seqs, counts, strict=True)])
        last_rows = torch.tensor(last if logits else [], dtype=torch.long, device=self.device)
        g, greedy = self._rows(0, ids, positions, tables, previous, last_rows)
        for seq, count in zip(seqs, counts, strict=True):
            seq.num_draft_computed += count
            seq.draft_hidden = seq.draft_hidden[count:] if count < len(seq.draft_hidden) else None
        return g[last_rows], greedy

    def _rows(
        self,
        depth: int,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
        previous: torch.Tensor,
        greedy_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(g of each row, greedy token of each of greedy_rows, all rows if None): token
        ids[i] at positions[i] of the sequence with block table tables[i], after hidden state
        previous[i]; every row's latent written before any row attends. In a graph when one
        holds the rows."""
        layer = depth % len(self.layers)
        fed = ids if isinstance(ids, torch.Tensor) else None
        graphs = None if self.graphs is None else self.graphs[layer]
        if graphs is not None and len(positions) <= graphs.max_batch:
            host_ids = None if fed is not None else ids
            step = graphs.run(host_ids, positions, tables, fed_ids=fed, previous=previous)
            greedy = step.greedy if greedy_rows is None else step.greedy[greedy_rows]
            return step.hidden, greedy
        lens = [p + 1 for p in positions]
        meta = AttentionMetadata.build(
            [1] * len(positions), lens, tables, self.kv_cache.block_size, self.device
        )
        g, logits = self.layers[layer].predict(
            self.target,
            fed if fed is not None else torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            previous,
            self.kv_cache.kv_caches[layer],
            dataclasses.replace(meta, new_kv_first=True),
            greedy_rows,
        )
        return g, logits.argmax(dim=-1)


def _covered(seq: Sequence) -> bool:
    """Whether the hidden states kept for seq reach its last token's position - 1. A sequence
    admitted with its prompt's MTP KV (num_draft_computed = its prompt length) is, after its
    first step here."""
    pending = 0 if seq.draft_hidden is None else len(seq.draft_hidden)
    return seq.num_draft_computed + pending == seq.num_tokens - 1 and pending > 0
