"""Cache-aware choice of a decode instance: a prompt goes where its start is likely cached.

A decode server that caches prefixes (--enable-prefix-caching) reserves a prompt with the
blocks of its start it still holds, and its prefill sends only the rest (Ticket.
num_cached_tokens); a multi-turn conversation resends its whole history every turn, so a turn
placed on the server that decoded the last one moves only what is new. The router cannot see
the servers' caches; it remembers, per instance, the names of the full prompt blocks it placed
there (the names the servers give them: engine/block_names.py), at most as many as the
instance has blocks, least recently placed forgotten first: an estimate, as SGLang's
cache-aware router keeps.

The choice (as SGLang's): while the load is balanced, the instance whose remembered blocks
cover the longest start of the prompt, if that is at least MIN_MATCH of the prompt; otherwise,
or while one instance's outstanding tokens exceed another's by more than IMBALANCE_TOKENS and
IMBALANCE_RATIO times, the least loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.block_names import block_names

MIN_MATCH = 0.5
IMBALANCE_TOKENS = 16384
IMBALANCE_RATIO = 1.5


class PlacedBlocks:
    """The names of the full prompt blocks placed on one instance, least recently placed
    first, at most `capacity`."""

    def __init__(self) -> None:
        self.capacity = 0
        """The instance's KV blocks, as its Stats said; 0 (remember nothing) until then."""
        self._names: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, names: Sequence[bytes]) -> int:
        """How many of `names`, from the first, are remembered."""
        count = 0
        for name in names:
            if name not in self._names:
                break
            count += 1
        return count

    def place(self, names: Sequence[bytes]) -> None:
        for name in names:
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)


def prompt_names(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The names of the prompt's blocks a server could take from its cache: the full ones
    before the block of its last token (which its senders always write)."""
    return block_names(token_ids, block_size, (len(token_ids) - 1) // block_size, [])


def choose(candidates: Sequence, token_ids: Sequence[int]) -> tuple[object, list[bytes]]:
    """The instance (a DecodeInstance: outstanding_tokens, block_size, prefix_caching, placed)
    to place a prompt on, by the rule above, and the prompt's names on it (empty where it
    does not cache prefixes), which `PlacedBlocks.place` records once it is placed there."""
    least = min(candidates, key=lambda d: d.outstanding_tokens)
    most = max(d.outstanding_tokens for d in candidates)
    imbalanced = (most - least.outstanding_tokens > IMBALANCE_TOKENS
                  and most > IMBALANCE_RATIO * least.outstanding_tokens)  # fmt: skip
    names = {}  # block size -> the prompt's names: hashed once a request
    for decode in candidates:
        if decode.prefix_caching and decode.block_size and decode.block_size not in names:
            names[decode.block_size] = prompt_names(token_ids, decode.block_size)
    best, best_tokens = least, 0
    if not imbalanced:
        for decode in candidates:
            if decode.prefix_caching and decode.block_size:
                tokens = decode.placed.matched(names[decode.block_size]) * decode.block_size
                if tokens > best_tokens or (
                    tokens == best_tokens > 0
                    and decode.outstanding_tokens < best.outstanding_tokens
                ):
                    best, best_tokens = decode, tokens
    chosen = best if best_tokens >= MIN_MATCH * len(token_ids) else least
    return chosen, names.get(chosen.block_size, []) if chosen.prefix_caching else []
