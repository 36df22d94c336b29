"""Automatic prefix caching, as vLLM's: a sequence whose leading blocks hold the tokens of blocks
computed before (by any sequence) takes their KV instead of computing it again.

A full block is named by a digest of its tokens and of the name of the block before it (sha256,
chained: two blocks share a name only when every token up to their ends is the same). Once a
forward has written a full block's KV (`Scheduler.update`), the block is named in the pool
(`BlockPool.name`); when its sequences have freed it, the pool keeps it with its KV and name,
and hands it out again only when no unnamed block is free, least recently freed first. A
waiting sequence without KV (new, or preempted) is admitted with the blocks of the longest run
of its names the pool still holds (`BlockPool.lookup`) and computes from there; its last token
is always computed, for the logits that sample the next one, so a cached block is never
written.

A decode server looks a remotely prefilled prompt up the same way when it reserves blocks for
its KV (`take_prompt`): the senders then write only the tokens after the blocks it found (the
ticket's `num_cached_tokens`), and the received blocks are named once a forward has run on them
as any others are.

With a speculative proposer that keeps a cache of its own (a draft model, MTP layers, an
EAGLE-3 head: its blocks are the target's block ids), a block is named only once the proposer's
KV of it is written too (`Sequence.num_draft_computed` covers it), and a sequence that takes
cached blocks takes the proposer's KV of them with the target's.
"""

from __future__ import annotations

import threading

from engine.block_names import block_names, reusable_blocks
from engine.kv_cache import BlockPool
from engine.sequence import Sequence


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, proposer_cache: bool = False) -> None:
        """`proposer_cache`: a speculative proposer keeps KV of its own in the same blocks."""
        self.pool = pool
        self.block_size = block_size
        self.proposer_cache = proposer_cache
        self.queried_tokens = 0
        """Tokens of the sequences admitted, looked up (vLLM's prefix_cache_queries)."""
        self.hit_tokens = 0
        """Of those, the ones whose KV was found (vLLM's prefix_cache_hits)."""
        self._counting = threading.Lock()
        """The engine's thread and a decode server's Reserve threads both count."""

    def take(self, seq: Sequence) -> int:
        """Gives a sequence without KV the cached blocks its tokens start with (one more owner
        each); their tokens count as computed. Returns how many tokens that is."""
        assert not seq.block_ids and seq.num_computed == 0
        usable = reusable_blocks(seq.num_tokens, self.block_size)
        seq.block_ids = self.pool.lookup(block_names(seq.token_ids, self.block_size, usable,
                                                     seq.block_names))  # fmt: skip
        seq.num_named = len(seq.block_ids)
        seq.num_computed = seq.num_named * self.block_size
        if self.proposer_cache:
            seq.num_draft_computed = seq.num_computed
        return seq.num_computed

    def take_prompt(self, names: list[bytes], num_tokens: int) -> list[int]:
        """The cached blocks a prompt of `num_tokens` whose KV comes from elsewhere starts
        with, one more owner each, by its reusable blocks' `names`
        (block_names.prompt_block_names: never its last token's block, so its senders always
        write something), and counts the lookup."""
        blocks = self.pool.lookup(names)
        self._count(num_tokens, len(blocks) * self.block_size)
        return blocks

    def count(self, seq: Sequence, hit_tokens: int) -> None:
        """Counts an admitted sequence's lookup (`take`'s result)."""
        self._count(seq.num_tokens, hit_tokens)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit_tokens

    def _count(self, queried: int, hit: int) -> None:
        with self._counting:
            self.queried_tokens += queried
            self.hit_tokens += hit

    def record(self, seq: Sequence) -> None:
        """Names the sequence's full blocks whose KV a finished forward has written (and the
        proposer's, if it keeps a cache)."""
        full = min(seq.num_computed, seq.num_tokens, len(seq.block_ids) * self.block_size)
        if self.proposer_cache:
            full = min(full, seq.num_draft_computed)
        full //= self.block_size
        if full <= seq.num_named:
            return
        names = block_names(seq.token_ids, self.block_size, full, seq.block_names)
        for i in range(seq.num_named, full):
            self.pool.name(seq.block_ids[i], names[i])
        seq.num_named = full
