"""Prompt tokenization with a per-segment cache: a multi-turn conversation re-tokenizes only the
turns it has not seen.

A rendered chat prompt is cut after every special token (`<|im_end|>`, `<|im_start|>`, ...).
Tokenizers split their input at special tokens before any merge, so the pieces tokenize
independently and their concatenation is the whole prompt's tokenization; each piece is cached.
That independence is a property of the tokenizer, not a law: `SegmentTokenizer.self_check`
verifies it on sample conversations, and a tokenizer that fails it is used whole, uncached.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence

from engine.chat_template import render_chat

SAMPLE_CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Grey waves fold and break,\nsalt wind combs the dune."},
        {"role": "user", "content": "Now one about  mountains, with two spaces. 山と海 🌊"},
    ],
    [
        {"role": "user", "content": " leading space, trailing space "},
        {"role": "assistant", "content": "\n\nnewlines\n"},
        {"role": "user", "content": "def f(x):\n    return x  # code"},
    ],
]


class SegmentTokenizer:
    def __init__(self, tokenizer, max_segments: int = 65536) -> None:
        self.tokenizer = tokenizer
        self.max_segments = max_segments
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        specials = sorted(tokenizer.all_special_tokens, key=len, reverse=True)
        # A capture group keeps the special tokens as their own pieces.
        self._split = (
            re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        )
        self.segmented = self._split is not None
        self.hits = 0
        self.misses = 0

    def render(self, messages: Sequence[dict], template: dict | None = None) -> str:
        """The conversation rendered by the chat template (engine/chat_template.py)."""
        return render_chat(self.tokenizer, messages, template)

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (special tokens are already in its text)."""
        if not self.segmented:
            return self._whole(text)
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece:
                ids += self._piece(piece)
        return ids

    def self_check(self, conversations: Sequence[Sequence[dict]] = SAMPLE_CONVERSATIONS) -> bool:
        """Whether segmenting gives exactly the whole-prompt ids on every prefix of every
        sample conversation; if not, segmenting is switched off."""
        for conversation in conversations:
            for turn in range(1, len(conversation) + 1):
                text = self.render(conversation[:turn])
                if self.encode(text) != self._whole(text):
                    self.segmented = False
                    self._cache.clear()
                    return False
        return True

    def _piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            self._cache.move_to_end(piece)
            self.hits += 1
            return cached
        self.misses += 1
        ids = self._whole(piece)
        self._cache[piece] = ids
        if len(self._cache) > self.max_segments:
            self._cache.popitem(last=False)
        return ids

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
