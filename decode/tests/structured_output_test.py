"""Structured output through the real tandem.v1.DecodeService: a first token the grammar refuses
fails Generate with INVALID_ARGUMENT (and the ticket, as a bad request), any choice's; an allowed
one streams output that stays in the grammar and stops when it is complete, each choice under a
grammar matcher of its own.

The tiny random-weight stack (decode/tests/stack.py) with SmolLM2's tokenizer cut to the tiny
model's 256 tokens: those are its special tokens and single characters, digits included, enough
for a regex over digits.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from decode.tests.stack import Stack
from engine.grammar import GrammarCompiler
from proto.tandem.v1 import decode_pb2

torch.set_num_threads(1)

TOKENIZER = Path("tools/smollm2-135m-instruct")  # Bazel data: //tools:smollm2
PROMPT = [1, 17, 99, 3, 250, 41, 7]
DIGITS = decode_pb2.StructuredOutput(regex="[0-9]{3}")


@pytest.fixture(scope="module")
def stack():
    stack = Stack()
    stack.engine.grammars = GrammarCompiler(str(TOKENIZER), stack.engine.model_config.vocab_size)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_a_refused_first_token_fails_and_an_allowed_one_streams_the_grammar(stack, tokenizer):
    [letter], [digit] = tokenizer.encode("A"), tokenizer.encode("4")
    ticket, _ = stack.ready("letter", PROMPT)
    with pytest.raises(grpc.RpcError) as err:
        list(stack.generate(ticket, letter, structured_output=DIGITS))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f"first_token_id: {letter} is not allowed by structured_output (the prefill must sample "
        "it under the same constraint)"
    )

    ticket, _ = stack.ready("digit", PROMPT)
    messages = list(stack.generate(ticket, digit, structured_output=DIGITS))
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens[0] == digit and tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.decode(tokens[:-1])
    assert len(text) == 3 and text.isdigit()
    assert messages[-1].finish_reason == decode_pb2.FINISH_REASON_STOP
    stack.assert_empty()


def test_every_choice_keeps_to_the_grammar_from_its_own_first_token(stack, tokenizer):
    [letter], [four], [seven] = (tokenizer.encode(c) for c in "A47")
    ticket, _ = stack.ready("choices-letter", PROMPT)
    starts = [decode_pb2.ChoiceStart(first_token_id=t) for t in (seven, letter)]
    with pytest.raises(grpc.RpcError) as err:
        list(stack.generate(ticket, four, structured_output=DIGITS, other_choices=starts))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"other_choices[1].first_token_id: {letter} is not")

    ticket, _ = stack.ready("choices", PROMPT)
    starts = [decode_pb2.ChoiceStart(first_token_id=seven)]
    messages = list(stack.generate(ticket, four, structured_output=DIGITS, other_choices=starts))
    for index, first in enumerate((four, seven)):
        tokens = [t for m in messages if m.index == index for t in m.token_ids]
        assert tokens[0] == first and tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        text = tokenizer.decode(tokens[:-1])
        assert len(text) == 3 and text.isdigit()
    stack.assert_empty()
