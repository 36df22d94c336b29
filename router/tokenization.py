"""Prompt tokenization with a per-segment cache: a multi-turn conversation re-tokenizes only the
turns it has not seen.

A rendered chat prompt is cut after every special token (`<|im_end|>`, `<|im_start|>`, ...).
Tokenizers split their input at special tokens before any merge, so the pieces tokenize
independently and their concatenation is the whole prompt's tokenization; each piece is cached.
That independence is a property of the tokenizer, not a law: `SegmentTokenizer.self_check`
verifies it on sample conversations, and a tokenizer that fails it is used whole, uncached.

A long piece (a pasted file, a random benchmark prompt) is cut into parts encoded as one batch,
which the tokenizer spreads over its threads: an 8k-token prompt took 34-50 ms whole on the
GPU machines' hosts. Byte-level BPE tokenizers whose pre-tokenizer is a regex (GPT-2's,
Llama-3's, Qwen's) and that normalize nothing always break their pre-tokens before a space that
follows a non-space, and BPE never merges across pre-tokens, so a piece cut there encodes as
the concatenation of its parts. Other tokenizers (SentencePiece's "▁" prefix, normalizers) are
not cut; `self_check` verifies the cut on a sample text too.
"""

from __future__ import annotations

import json
import random
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


CUT_PIECES_OVER = 4096
"""Characters: a longer piece is cut into parts of about CUT_PART characters (see above)."""
CUT_PART = 2048


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
        self._backend = _byte_level_regex_backend(tokenizer)
        self.cut = self._backend is not None
        """Whether long pieces are cut into parts encoded as a batch."""
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
        sample conversation; if not, segmenting is switched off. Cutting long pieces is
        checked too, on a sample text cut every few words, and switched off if it differs."""
        if self.cut:
            sample = _cut_sample(conversations)
            self.cut = self._encode_parts(_parts(sample, 16)) == self._encode_whole(sample)
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
        if self.cut and len(text) > CUT_PIECES_OVER:
            return self._encode_parts(_parts(text, CUT_PART))
        return self._encode_whole(text)

    def _encode_whole(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_parts(self, parts: list[str]) -> list[int]:
        encodings = self._backend.encode_batch(parts, add_special_tokens=False)
        return [token for encoding in encodings for token in encoding.ids]


def _parts(text: str, size: int) -> list[str]:
    """`text` cut before a space that follows a non-space, about every `size` characters."""
    parts, start = [], 0
    while start + size < len(text):
        cut = text.find(" ", start + size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


def _byte_level_regex_backend(tokenizer):
    """The tokenizer's Rust backend if it normalizes nothing and pre-tokenizes by a regex into
    byte-level pieces with no prefix space (the tokenizers whose pieces can be cut); else
    None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if spec.get("normalizer") is not None or kinds not in (["ByteLevel"], ["Split", "ByteLevel"]):
        return None
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        return None
    if kinds == ["ByteLevel"]:
        return backend if byte_level.get("use_regex", True) else None
    split = steps[0]
    regex = split.get("behavior") == "Isolated" and not split.get("invert")
    return backend if regex and "Regex" in (split.get("pattern") or {}) else None


def _cut_sample(conversations: Sequence[Sequence[dict]]) -> str:
    """A text with the sample conversations' contents and runs of the characters regex
    pre-tokenizers treat apart (spaces, newlines, digits, punctuation, contractions, letters
    of other scripts), long enough to be cut many times."""
    contents = [message["content"] for conversation in conversations for message in conversation]
    pieces = [*contents, " ", "  ", "\n", "\n\n", "\t", " \n", "\r\n", "123", "45678", ".",
              "'s", "'T", "{}", "()", "--", "é", "山", "🌊", "x", "Word"]  # fmt: skip
    rng = random.Random(0)
    return "".join(rng.choice(pieces) for _ in range(2000))
