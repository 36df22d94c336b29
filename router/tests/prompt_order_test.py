"""PromptLogprobsFirst (router/prompt_order.py): a request's prompt log-probabilities come
before its first Tokens or Finished, for every choice; a local prefill's other choices wait
for choice 0's first message; a count that does not match the prompt is a 502."""

import pytest

from proto.tandem.v1 import decode_pb2
from router.errors import BackendError
from router.generation import Finished, PromptLogprobs, Tokens
from router.prompt_order import PromptLogprobsFirst

PROMPT = [5, 6, 7]
ENTRIES = [decode_pb2.TokenLogprobs(logprob=-1.0, rank=2), decode_pb2.TokenLogprobs(rank=1)]


def _message(index: int, *entries) -> tuple[decode_pb2.GenerateResponse, list]:
    message = decode_pb2.GenerateResponse(token_ids=[9], index=index, prompt_logprobs=entries)
    return message, [Tokens([9], index=index)]


def test_a_prefills_come_before_the_first_message_and_only_then():
    order = PromptLogprobsFirst(2, PROMPT, ENTRIES, from_decode=False)
    first, second = _message(1), _message(0)
    assert order.items(*first) == [PromptLogprobs(PROMPT, ENTRIES, 0),
                                   PromptLogprobs(PROMPT, ENTRIES, 1), *first[1]]  # fmt: skip
    assert order.items(*second) == second[1]


def test_a_local_prefills_other_choices_wait_for_choice_zeros_first_message():
    order = PromptLogprobsFirst(2, PROMPT, None, from_decode=True)
    early = _message(1)
    ended = (decode_pb2.GenerateResponse(index=1), [Finished("length", 3, 1, 1)])
    assert order.items(*early) == [] and order.items(*ended) == []
    zero = _message(0, *ENTRIES)
    assert order.items(*zero) == [PromptLogprobs(PROMPT, ENTRIES, 0),
                                  PromptLogprobs(PROMPT, ENTRIES, 1),
                                  *early[1], *ended[1], *zero[1]]  # fmt: skip
    later = _message(0)
    assert order.items(*later) == later[1]


def test_none_asked_none_added():
    order = PromptLogprobsFirst(1, PROMPT, None, from_decode=False)
    message = _message(0)
    assert order.items(*message) == message[1]


def test_a_local_prefill_whose_count_is_not_the_prompts_is_a_502():
    order = PromptLogprobsFirst(1, PROMPT, None, from_decode=True)
    with pytest.raises(BackendError, match="sent 1 prompt log-probabilities for 3 prompt tokens"):
        order.items(*_message(0, ENTRIES[0]))
