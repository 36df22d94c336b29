"""A Generate with local_prefill through the real tandem.v1.DecodeService (decode/tests/stack.py:
a tiny random-weight engine on the CPU, over gRPC): no Reserve and no sender, the decode server
prefills the prompt itself. Greedy tokens equal one engine doing the whole request and a
handed-over request's; a logit bias holds from the first token on; logprobs come with every
token, the first included, and the prompt's on choice 0's first message; n choices each sample
with seed + i as a handed-over request's choices do; an Abort and a bad parameter take effect
as for a ticket. Every test ends with the pool all free and no request live.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from decode.tests.stack import BLOCK, BLOCKS, NEW_TOKENS, rpc_failure
from engine.sampling import SamplingParams
from engine.sampling_ranges import MAX_N
from engine.sequence import StopConditions
from proto.tandem.v1 import decode_pb2

torch.set_num_threads(1)

PROMPT = list(range(10, 50))  # 40 tokens: three blocks of 16, the last partial
LENGTH, ABORT = decode_pb2.FINISH_REASON_LENGTH, decode_pb2.FINISH_REASON_ABORT


def _local(request_id: str, prompt: list[int], n: int = 0, **kwargs):
    kwargs.setdefault("max_tokens", NEW_TOKENS)
    return decode_pb2.GenerateRequest(
        request_id=request_id,
        local_prefill=decode_pb2.LocalPrefill(prompt_token_ids=prompt, n=n),
        **kwargs,
    )


def _tokens(messages, index: int = 0) -> list[int]:
    return [t for m in messages if m.index == index for t in m.token_ids]


def test_greedy_tokens_equal_one_engine_and_a_handed_over_request(stack):
    messages = list(stack.stub.Generate(_local("local", PROMPT), timeout=30))
    assert _tokens(messages) == stack.prefill.reference(PROMPT)
    assert messages[-1].finish_reason == LENGTH
    assert messages[-1].usage == decode_pb2.Usage(
        prompt_tokens=len(PROMPT), completion_tokens=NEW_TOKENS
    )
    ticket, first = stack.ready("handed-over", PROMPT)
    assert _tokens(stack.generate(ticket, first)) == _tokens(messages)


def test_logprobs_and_seeded_choices_are_as_for_a_ticket(stack):
    sampling = decode_pb2.SamplingParams(temperature=0.8, seed=7, logprobs=2)
    request = _local("n", PROMPT, n=2, sampling=sampling, ignore_eos=True)
    messages = list(stack.stub.Generate(request, timeout=30))
    for index in (0, 1):
        mine = [m for m in messages if m.index == index]
        assert sum(len(m.token_ids) for m in mine) == NEW_TOKENS
        assert all(len(m.logprobs) == len(m.token_ids) for m in mine)
        assert all(len(lp.top_token_ids) == 2 for m in mine for lp in m.logprobs)
        assert mine[-1].finish_reason == LENGTH
        alone = decode_pb2.SamplingParams(temperature=0.8, seed=7 + index, logprobs=2)
        request = _local(f"alone{index}", PROMPT, sampling=alone, ignore_eos=True)
        assert _tokens(stack.stub.Generate(request, timeout=30)) == _tokens(messages, index)


def test_prompt_logprobs_come_on_choice_zeros_first_message_and_a_ticket_ignores_them(stack):
    sampling = decode_pb2.SamplingParams(prompt_logprobs=3, seed=1, temperature=1.0)
    messages = list(stack.stub.Generate(_local("p", PROMPT, n=2, sampling=sampling), timeout=30))
    firsts = {}
    for m in messages:
        firsts.setdefault(m.index, m)
    assert [m.prompt_logprobs for m in messages if m is not firsts[0]] == [[]] * (len(messages) - 1)
    got = firsts[0].prompt_logprobs
    stack.prefill.engine.add_request("ref", PROMPT, SamplingParams(prompt_logprobs=3),
                                     StopConditions(max_tokens=1))  # fmt: skip
    [out] = stack.prefill.engine.step()
    assert len(got) == len(PROMPT) - 1
    for mine, expected in zip(got, out.prompt_logprobs, strict=True):
        assert mine.logprob == pytest.approx(expected.logprob, abs=1e-5)
        assert mine.rank == expected.rank >= 1
        assert list(mine.top_token_ids) == list(expected.top_token_ids)
    ticket, first = stack.ready("ticket", PROMPT)
    handed = stack.generate(ticket, first, sampling=decode_pb2.SamplingParams(prompt_logprobs=3))
    assert not any(m.prompt_logprobs for m in handed)


def test_a_logit_bias_holds_for_the_first_token_and_every_one_after(stack):
    """+100 on one token outweighs the tiny model's logits: every token is it; -100 on the
    plain greedy tokens keeps each of them out."""
    forced = decode_pb2.SamplingParams(logit_bias={42: 100.0})
    request = _local("forced", PROMPT, sampling=forced, ignore_eos=True)
    assert _tokens(stack.stub.Generate(request, timeout=30)) == [42] * NEW_TOKENS
    plain = stack.prefill.reference(PROMPT)
    banned = decode_pb2.SamplingParams(logit_bias=dict.fromkeys(plain, -100.0))
    request = _local("banned", PROMPT, sampling=banned, ignore_eos=True)
    assert not set(_tokens(stack.stub.Generate(request, timeout=30))) & set(plain)


def test_an_abort_stops_it_and_a_live_id_is_refused(stack):
    stream = stack.stub.Generate(_local("long", PROMPT, max_tokens=300, ignore_eos=True))
    assert next(stream).token_ids
    stack.engine.hold()  # running, for sure, until released
    code, details = rpc_failure(lambda: list(stack.stub.Generate(_local("long", [5]))))
    assert (code, details) == (grpc.StatusCode.ALREADY_EXISTS, "request 'long' is already live")
    assert stack.abort("long")
    stack.engine.release()
    assert list(stream)[-1].finish_reason == ABORT


def test_refusals_name_the_values(stack):
    refusals = [
        (_local("empty", []), "prompt_token_ids: must not be empty"),
        (
            _local("big", [5] * (BLOCKS * BLOCK)),
            "prompt of 384 tokens + max_tokens 10 exceeds the context length 384",
        ),
        (_local("vocab", [5, 256]), "prompt: token id 256 is outside the vocabulary [0, 256)"),
        (
            _local("others", PROMPT, other_choices=[decode_pb2.ChoiceStart(first_token_id=5)]),
            "other_choices: not with local_prefill (local_prefill.n gives the choices)",
        ),
        (_local("many", PROMPT, n=MAX_N + 1), f"n: {MAX_N + 1} choices, not in [1, {MAX_N}]"),
        (
            _local("bias", PROMPT, sampling=decode_pb2.SamplingParams(logit_bias={256: 1.0})),
            "logit_bias: token id 256 is outside the vocabulary [0, 256)",
        ),
        (
            _local("hot", PROMPT, sampling=decode_pb2.SamplingParams(temperature=-1)),
            None,  # the engine's own message
        ),
    ]
    for request, message in refusals:
        code, details = rpc_failure(lambda r=request: list(stack.stub.Generate(r, timeout=30)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert message is None or details == message, details
