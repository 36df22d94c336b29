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

With a speculative proposer that keeps a cache of its own (a draft model, MTP layers, an
EAGLE-3 head: its blocks are the target's block ids), a block is named only once the proposer's
KV of it is written too (`Sequence.num_draft_computed` covers it), and a sequence that takes
cached blocks takes the proposer's KV of them with the target's.
"""

from __future__ import annotations

import hashlib
from array import array

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

    def take(self, seq: Sequence) -> int:
        """Gives a sequence without KV the cached blocks its tokens start with (one more owner
        each); their tokens count as computed. Returns how many tokens that is."""
        assert not seq.block_ids and seq.num_computed == 0
        usable = (seq.num_tokens - 1) // self.block_size
        seq.block_ids = self.pool.lookup(self._names(seq, usable))
        seq.num_named = len(seq.block_ids)
        seq.num_computed = seq.num_named * self.block_size
        if self.proposer_cache:
            seq.num_draft_computed = seq.num_computed
        return seq.num_computed

    def count(self, seq: Sequence, hit_tokens: int) -> None:
        """Counts an admitted sequence's lookup (`take`'s result)."""
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit_tokens

    def record(self, seq: Sequence) -> None:
        """Names the sequence's full blocks whose KV a finished forward has written (and the
        proposer's, if it keeps a cache)."""
        full = min(seq.num_computed, seq.num_tokens, len(seq.block_ids) * self.block_size)
        if self.proposer_cache:
            full = min(full, seq.num_draft_computed)
        full //= self.block_size
        if full <= seq.num_named:
            return
        names = self._names(seq, full)
        for i in range(seq.num_named, full):
            self.pool.name(seq.block_ids[i], names[i])
        seq.num_named = full

    def _names(self, seq: Sequence, count: int) -> list[bytes]:
        """The names of the sequence's first `count` full blocks (kept on it: its tokens only
        grow)."""
        names, size = seq.block_names, self.block_size
        while len(names) < count:
            start = len(names) * size
            tokens = array("q", seq.token_ids[start : start + size])  # int64
            digest = hashlib.sha256(names[-1] if names else b"tandem-prefix")
            digest.update(tokens.tobytes())
            names.append(digest.digest())
        return names[:count]
