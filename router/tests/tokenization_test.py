"""Per-segment tokenization equals whole-prompt tokenization on real multi-turn prompts (the
bundled SmolLM2's tokenizer and ChatML template), and re-tokenizes only what is new; long pieces
cut into parts encode as whole ones (SmolLM2's regex, and Llama-3's on a BPE trained here)."""

import random
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

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


# Llama-3's pre-tokenizer regex (tokenizer.json of Meta-Llama-3).
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ALPHABET = ["foo", "Bar", " ", "  ", "\n", "\n\n", "\t", "123", "45678", ".", ",", "'s", "'T",
            "{", "}", "()", "é", "山", "🌊", " \n", "\r\n", "  \n ", "--", "x"]  # fmt: skip


def _texts(count: int, length: int) -> list[str]:
    """Texts of the characters regex pre-tokenizers treat apart, in random runs."""
    rng = random.Random(7)
    return ["".join(rng.choice(ALPHABET) for _ in range(length)) for _ in range(count)]


def _trained(pre_tokenizer) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with `pre_tokenizer`, trained here on this repository's
    router sources."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizer
    model.decoder = decoders.ByteLevel()
    corpus = [path.read_text() for path in sorted(Path("router").glob("*.py"))] + _texts(50, 300)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    model.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")
    hf.chat_template = "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    return hf


def _assert_cut_equals_whole(tok: SegmentTokenizer, hf) -> None:
    cut = []
    encode_parts = tok._encode_parts
    tok._encode_parts = lambda parts: cut.append(len(parts)) or encode_parts(parts)
    for text in _texts(20, 3000):
        assert tok.encode(text) == _whole(hf, text)
    assert len(cut) == 20 and min(cut) > 1  # each text went in parts


def test_long_pieces_are_cut_and_encode_as_whole_by_the_bundled_tokenizer(hf):
    tok = SegmentTokenizer(hf)  # GPT-2's regex
    assert tok.self_check() and tok.cut
    _assert_cut_equals_whole(tok, hf)


def test_long_pieces_are_cut_and_encode_as_whole_by_llama3s_regex():
    hf = _trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))  # fmt: skip
    tok = SegmentTokenizer(hf)
    assert tok.self_check() and tok.cut
    _assert_cut_equals_whole(tok, hf)


def test_pieces_whose_tokens_may_span_spaces_are_not_cut():
    # Whole lines as pre-tokens: BPE merges across spaces, so a cut would change the ids. It
    # passes the tokenizer's description; the self-check's sample finds it out.
    hf = _trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[^\n]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))  # fmt: skip
    tok = SegmentTokenizer(hf)
    assert tok.cut
    tok.self_check()
    assert not tok.cut
    text = _texts(1, 3000)[0]
    assert tok.encode(text) == _whole(hf, text)


def test_a_sentencepiece_style_tokenizer_is_not_cut():
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>"])
    model.train_from_iterator(_texts(20, 300), trainer)
    assert not SegmentTokenizer(PreTrainedTokenizerFast(tokenizer_object=model)).cut
