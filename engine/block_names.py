"""The names prefix caching gives full blocks of tokens (engine/prefix_cache.py): a sha256
chained over the blocks, so two blocks share a name only when every token up to their ends is
the same. Torch-free: the router names a prompt's blocks as its decode servers do, to send a
prompt where its start is cached (router/prefix_affinity.py)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_names(
    token_ids: Sequence[int], block_size: int, count: int, names: list[bytes]
) -> list[bytes]:
    """The names of the first `count` full blocks of `token_ids`, extending `names` (those of
    its first blocks computed before, kept by a sequence: its tokens only grow)."""
    while len(names) < count:
        start = len(names) * block_size
        tokens = array("q", token_ids[start : start + block_size])  # int64
        digest = hashlib.sha256(names[-1] if names else b"tandem-prefix")
        digest.update(tokens.tobytes())
        names.append(digest.digest())
    return names[:count]


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """The full blocks of a prompt of `num_tokens` that a cache may hold for it: all before
    the block of its last token, whose KV is always computed (its logits sample the next
    token) or sent."""
    return (num_tokens - 1) // block_size


def prompt_block_names(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The names of a prompt's reusable blocks (`reusable_blocks`)."""
    return block_names(token_ids, block_size, reusable_blocks(len(token_ids), block_size), [])
