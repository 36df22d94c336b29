"""Per-segment tokenization equals whole-prompt tokenization on real multi-turn prompts (the
bundled SmolLM2's tokenizer and ChatML template), and re-tokenizes only what is new."""

import pytest
from transformers import AutoTokenizer

from router.tokenization import SAMPLE_CONVERSATIONS, SegmentTokenizer

MODEL = "tools/smollm2-135m-instruct"  # Bazel data: //tools:smollm2

CONVERSATION = [
    {"role": "system", "content": "You are a coding agent. Use tools when needed."},
    {"role": "user", "content": "Fix the failing test in parser.py"},
    {"role": "assistant", "content": "Reading parser.py:\n```python\ndef parse(s):\n    ...```"},
    {"role": "user", "content": "Tool output: 3 passed, 1 failed (test_unicode: 'é' != 'e')"},
    {"role": "assistant", "content": "The normaliser strips accents; keep them. 修正しました 👍"},
    {"role": "user", "content": "Now run   the whole suite.\n\n"},
]


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(MODEL)


def _whole(hf, text):
    return hf(text, add_special_tokens=False)["input_ids"]


def test_self_check_passes_for_the_bundled_tokenizer(hf):
    tok = SegmentTokenizer(hf)
    assert tok.self_check()
    assert tok.segmented


def test_each_turn_equals_whole_tokenization_and_only_new_segments_miss(hf):
    tok = SegmentTokenizer(hf)
    previous_misses = 0
    for turn in range(1, len(CONVERSATION) + 1):
        text = tok.render(CONVERSATION[:turn])
        assert tok.encode(text) == _whole(hf, text)
        new = tok.misses - previous_misses
        previous_misses = tok.misses
        if turn > 1:
            # Only the new message's pieces (content, role header, generation prompt) miss.
            assert new <= 4, new
    assert tok.hits > tok.misses


def test_the_cache_is_bounded(hf):
    tok = SegmentTokenizer(hf, max_segments=3)
    for i in range(10):
        tok.encode(tok.render([{"role": "user", "content": f"message {i}"}]))
    assert len(tok._cache) == 3


class _PrefixingTokenizer:
    """A stand-in whose tokenization depends on position, as SentencePiece's "prepend on first
    section" does: it marks the start of every call, so pieces tokenized alone differ."""

    all_special_tokens = ("<s>", "</s>")

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<s>{m['content']}</s>" for m in messages)

    def __call__(self, text, add_special_tokens):
        ids = [0]  # the "start of input" marker
        for part in text.replace("<s>", "\x01").replace("</s>", "\x02"):
            ids.append(ord(part))
        return {"input_ids": ids}


def test_a_tokenizer_that_is_not_segment_safe_is_used_whole():
    tok = SegmentTokenizer(_PrefixingTokenizer())
    assert not tok.self_check(SAMPLE_CONVERSATIONS)
    text = tok.render(CONVERSATION)
    assert tok.encode(text) == _PrefixingTokenizer()(text, False)["input_ids"]
