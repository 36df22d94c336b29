"""Cache-aware choice of a decode instance: a prompt goes where its start is likely cached.

A decode server that caches prefixes (--enable-prefix-caching) reserves a prompt with the
blocks of its start it still holds, and its prefill sends only the rest (Ticket.
num_cached_tokens); a multi-turn conversation resends its whole history every turn, so a turn
placed on the server that decoded the last one moves only what is new. The router cannot see
the servers' caches; it remembers, per instance, the names of the full prompt blocks it placed
there (the names the servers give them: engine/block_names.py), at most as many as the
instance has blocks, least recently placed forgotten first: an estimate, as SGLang's
cache-aware router keeps.

The choice (as Dynamo's KV router costs it): among instances that cache prefixes, the one that
would have the fewest tokens in hand once it took the prompt: the prompt's tokens it does not
hold plus the KV tokens of the requests already placed there (`active_tokens`: prompt and
maximum output each). A conversation's next turn so follows its history while the server
holding it is no busier than what it saves, and a start every prompt shares (a system prompt)
does not draw every request to one server. Ties, and instances that cache nothing: the
fewest outstanding tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.block_names import prompt_block_names


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
        # The first blocks last: forgotten last, as a prompt's start is matched before its end.
        for name in reversed(names):
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)


def choose(candidates: Sequence, token_ids: Sequence[int]) -> tuple[object, list[bytes]]:
    """The instance (a DecodeInstance: outstanding_tokens, active_tokens, block_size,
    prefix_caching, placed) to place a prompt on, by the rule above, and the prompt's names on
    it (empty where it does not cache prefixes), which `PlacedBlocks.place` records once it is
    placed there."""
    if not any(_caches(d) for d in candidates):
        return min(candidates, key=lambda d: d.outstanding_tokens), []
    names = {}  # block size -> the prompt's names: hashed once a request
    for decode in filter(_caches, candidates):
        if decode.block_size not in names:
            names[decode.block_size] = prompt_block_names(token_ids, decode.block_size)

    def cost(decode) -> tuple[int, int]:
        held = 0
        if _caches(decode):
            held = decode.placed.matched(names[decode.block_size]) * decode.block_size
        return len(token_ids) - held + decode.active_tokens, decode.outstanding_tokens

    chosen = min(candidates, key=cost)
    return chosen, names[chosen.block_size] if _caches(chosen) else []


def _caches(decode) -> bool:
    return decode.prefix_caching and decode.block_size > 0
