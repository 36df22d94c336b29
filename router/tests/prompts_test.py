"""Prompts to token ids (router/prompts.py) with vLLM's add_special_tokens: a completions
text gets the tokenizer's BOS unless told not to; a chat gets only what its template writes
unless told to add it; a router that tokenizes through the prefill passes the choice on."""

import asyncio

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from router.prompts import PromptTokenizer
from router.tokenization import SegmentTokenizer

VOCAB = {"<s>": 0, "[UNK]": 1, "hi": 2, "user": 3, ":": 4, "there": 5}
MESSAGES = [{"role": "user", "content": "hi"}]


def _tokenizer() -> PreTrainedTokenizerFast:
    model = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    model.post_processor = bos
    hf = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", unk_token="[UNK]")
    hf.chat_template = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
    return hf


class _Prefill:
    """The orchestrator's /tokenize, recording each body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def tokenize(self, body: dict) -> list[int]:
        self.bodies.append(body)
        return [7]


def test_the_router_adds_special_tokens_as_vllm_does():
    prompts = PromptTokenizer(SegmentTokenizer(_tokenizer()), _Prefill())
    assert asyncio.run(prompts.text("hi there")) == [0, 2, 5]
    assert asyncio.run(prompts.text("hi there", add_special_tokens=False)) == [2, 5]
    assert asyncio.run(prompts.chat(MESSAGES)) == [3, 4, 2]
    assert asyncio.run(prompts.chat(MESSAGES, add_special_tokens=True)) == [0, 3, 4, 2]


def test_a_router_tokenizing_through_the_prefill_passes_the_choice_on():
    prefill = _Prefill()
    prompts = PromptTokenizer(SegmentTokenizer(_tokenizer()), prefill)
    prompts.source = "prefill"
    asyncio.run(prompts.text("hi", add_special_tokens=False))
    asyncio.run(prompts.chat(MESSAGES, add_special_tokens=True))
    asyncio.run(prompts.chat(MESSAGES))
    assert [b.get("add_special_tokens") for b in prefill.bodies] == [False, True, None]
