"""Streaming detokenization matches decoding everything at once, with characters that span
several byte-level tokens never emitted half-done."""

import pytest
from transformers import AutoTokenizer

from router.detokenizer import IncrementalDetokenizer

MODEL = "tools/smollm2-135m-instruct"  # Bazel data: //tools:smollm2
TEXT = "Hello 世界! Emoji: 🌊🏔️👩‍💻 — café, naïve, Ω≈ç√. Done."


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(MODEL)


def test_stream_equals_whole_decode_and_holds_back_split_characters(hf):
    ids = hf(TEXT, add_special_tokens=False)["input_ids"]
    # The text really has characters split across tokens: alone, such a token decodes to U+FFFD.
    assert any("\ufffd" in hf.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(hf, prompt_ids=hf("Prompt:")["input_ids"])
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == hf.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_several_tokens_at_once(hf):
    ids = hf(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(hf)
    out = "".join(detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert out == TEXT and detok.text == TEXT


def test_special_tokens_are_skipped(hf):
    detok = IncrementalDetokenizer(hf)
    ids = hf("Hi", add_special_tokens=False)["input_ids"] + [hf.convert_tokens_to_ids("<|im_end|>")]
    assert detok.add(ids) + detok.flush() == "Hi"
