"""How logprobs name tokens (engine.openai_logprobs.token_texts): as vLLM's
convert_ids_list_to_tokens names them, for a SentencePiece-style (Metaspace) tokenizer, whose
decode drops a token's leading space, and a byte-level one."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

from engine.openai_logprobs import token_texts

VOCAB = {"\u2581hello": 0, "\u2581world": 1, "hi": 2, "[UNK]": 3, "\u2581\u2581x": 4, ",": 5}


def _tokenizer(pre_tokenizer, decoder) -> PreTrainedTokenizerFast:
    model = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    model.pre_tokenizer, model.decoder = pre_tokenizer, decoder
    return PreTrainedTokenizerFast(tokenizer_object=model)


def test_a_metaspace_tokens_leading_spaces_are_kept_as_vllm_keeps_them():
    alone = _tokenizer(pre_tokenizers.Metaspace(), decoders.Metaspace())
    within = _tokenizer(pre_tokenizers.Sequence([pre_tokenizers.Metaspace()]), decoders.Metaspace())
    for tokenizer in (alone, within):
        text = token_texts(tokenizer)
        ids = list(VOCAB.values())
        assert [text(t) for t in ids] == convert_ids_list_to_tokens(tokenizer, ids)
        assert text(0) == " hello" and text(4) == "  x" and tokenizer.decode([0]) == "hello"


def test_a_byte_level_token_is_its_decoded_text():
    tokenizer = _tokenizer(pre_tokenizers.ByteLevel(), decoders.ByteLevel())
    text = token_texts(tokenizer)
    ids = list(VOCAB.values())
    assert [text(t) for t in ids] == convert_ids_list_to_tokens(tokenizer, ids)
    assert [text(t) for t in ids] == [tokenizer.decode([t]) for t in ids]
