"""Incremental detokenization: text for each new token id as it streams in, correct when one
character (an emoji, a CJK character) spans several byte-level tokens.

Decoding a token alone is wrong for byte-level BPE (half a UTF-8 sequence decodes to U+FFFD) and
for SentencePiece (leading-space handling depends on the token before). So the detokenizer keeps
a small window: it decodes the tokens from `prefix_offset` twice, without and with the new ones,
and emits the difference, holding text back while it ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
# Tokens kept before the new ones, so that decoding sees their context.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        self.text = ""
        """Everything emitted so far (generated text only)."""

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends generated tokens; returns the text they complete (may be empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or the last character is still incomplete
        new = full[len(prefix) :]
        self.prefix_offset = max(self.read_offset, len(self.ids) - _CONTEXT_TOKENS)
        self.read_offset = len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, replacement characters included."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = self.prefix_offset = len(self.ids)
        self.text += new
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )
