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
