"""OpenAI's n through the real tandem.v1.DecodeService (decode/tests/stack.py: a tiny random-weight
engine on the CPU, over gRPC): a Generate with other_choices streams every choice, each message
tagged with its choice, each choice ending with its own finish reason and usage, and each choice
decoding the tokens of a request of its own started from its first token (seed + i for choice
i). An Abort naming choices stops those of a running request and no other, and nothing of a
request in any other state. A bad choice start fails the ticket, naming the choice. Every test
ends with the pool all free and no request live.

The engine loop's TokenStream, which multiplexes the choices, is tested alone first.
"""

from __future__ import annotations

from collections import defaultdict

import grpc
import torch

from decode.engine_loop import EngineFailed, Finished, Tokens, TokenStream
from decode.tests.stack import NEW_TOKENS, Stack, rpc_failure
from engine.sequence import FinishReason
from proto.tandem.v1 import decode_pb2

torch.set_num_threads(1)

PROMPT = list(range(10, 31))  # 21 tokens: a partial last block of 16, copied per choice
SEEDED = decode_pb2.SamplingParams(temperature=0.05, seed=99, logprobs=1)
LENGTH, ABORT = decode_pb2.FINISH_REASON_LENGTH, decode_pb2.FINISH_REASON_ABORT


def test_a_stream_multiplexes_its_choices_and_ends_after_the_last():
    ended = []
    stream = TokenStream(num_choices=2, on_end=lambda: ended.append(True))
    done = Finished(FinishReason.LENGTH, 3, 2)
    stream.put(0, 5)
    stream.put(1, 6)
    stream.end(1, Finished(FinishReason.ABORT, 3, 1))
    stream.put(0, 7)
    assert not ended
    stream.end(0, done, (8, None))
    stream.end(0, done)  # ended already: ignored
    stream.fail(EngineFailed("late"))  # every choice ended: ignored
    assert ended == [True]
    assert list(stream) == [
        Tokens(0, [5, 7, 8], [], done),
        Tokens(1, [6], [], Finished(FinishReason.ABORT, 3, 1)),
    ]
    failing = TokenStream(num_choices=2, on_end=lambda: ended.append(True))
    failing.put(1, 4)
    failing.fail(EngineFailed("engine gone"))
    assert list(failing) == [Tokens(1, [4], []), EngineFailed("engine gone")]
    assert ended == [True, True]


def _by_choice(messages) -> dict[int, list]:
    choices = defaultdict(list)
    for message in messages:
        choices[message.index].append(message)
    return dict(choices)


def _tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _reported(token: int) -> decode_pb2.TokenLogprobs:
    """A first token's log-probabilities, as a prefill would report them."""
    return decode_pb2.TokenLogprobs(logprob=-0.5, top_token_ids=[token], top_logprobs=[-0.5])


def _start(token: int) -> decode_pb2.ChoiceStart:
    return decode_pb2.ChoiceStart(first_token_id=token, first_token_logprobs=_reported(token))


def _generate(stack: Stack, request_id: str, firsts: list[int], seed: int) -> list:
    """A Generate of PROMPT whose choices start from `firsts`, read to its end."""
    ticket, _ = stack.ready(request_id, PROMPT)
    sampling = decode_pb2.SamplingParams()
    sampling.CopyFrom(SEEDED)
    sampling.seed = seed
    request = stack.generate_request(
        ticket, firsts[0], sampling=sampling, ignore_eos=True,
        first_token_logprobs=_reported(firsts[0]), other_choices=[_start(t) for t in firsts[1:]],
    )  # fmt: skip
    return list(stack.stub.Generate(request, timeout=30))


def test_every_choice_streams_as_a_request_of_its_own(stack):
    firsts = [3, 7, 42]
    before = stack.stub.Stats(decode_pb2.StatsRequest(), timeout=10).tokens_generated
    choices = _by_choice(_generate(stack, "n", firsts, SEEDED.seed))
    after = stack.stub.Stats(decode_pb2.StatsRequest(), timeout=10).tokens_generated
    assert after - before == len(firsts) * NEW_TOKENS  # every choice's tokens count
    assert sorted(choices) == [0, 1, 2]
    for i, first in enumerate(firsts):
        messages = choices[i]
        assert [m.finish_reason for m in messages] == [0] * (len(messages) - 1) + [LENGTH]
        assert messages[-1].usage == decode_pb2.Usage(
            prompt_tokens=len(PROMPT), completion_tokens=NEW_TOKENS
        )
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
        assert messages[0].logprobs[0] == _reported(first)
        [alone] = _by_choice(_generate(stack, f"alone{i}", [first], SEEDED.seed + i)).values()
        assert _tokens(messages) == _tokens(alone)


def test_an_abort_of_some_choices_ends_them_and_the_others_go_on(stack):
    busy, first = stack.ready("busy", list(range(40)))
    busy = stack.generate(busy, first, ignore_eos=True, max_tokens=300)
    assert next(busy).token_ids[0] == first
    ticket, first = stack.ready("some", PROMPT)
    assert not stack.abort("some", choices=[1])  # not running: left as it is
    stack.engine.hold()
    others = [decode_pb2.ChoiceStart(first_token_id=first)]
    request = stack.generate_request(ticket, first, ignore_eos=True, other_choices=others)
    generate, context, messages = stack.generate_directly(request)
    assert context.handed_over.wait(timeout=10)  # queued for the engine thread, held
    assert stack.abort("some", choices=[1, 5])  # no choice 5: passed over
    stack.engine.release()
    generate.join(timeout=10)
    choices = _by_choice(messages)
    assert _tokens(choices[1]) == [first]  # the prefill's token, and no other
    assert choices[1][-1].finish_reason == ABORT
    assert choices[1][-1].usage.completion_tokens == 1
    assert len(_tokens(choices[0])) == NEW_TOKENS and choices[0][-1].finish_reason == LENGTH
    assert not stack.abort("some", choices=[0])  # finished
    assert stack.abort("busy")
    assert list(busy)[-1].finish_reason == ABORT


def test_a_bad_choice_start_fails_the_ticket_naming_the_choice(stack):
    lopsided = decode_pb2.ChoiceStart(
        first_token_id=5,
        first_token_logprobs=decode_pb2.TokenLogprobs(top_token_ids=[5, 6], top_logprobs=[-1.0]),
    )
    refusals = [
        ([_start(5), lopsided], "other_choices[1].first_token_logprobs: 2 top_token_ids but 1 "
         "top_logprobs"),
        ([decode_pb2.ChoiceStart(first_token_id=5)],
         "other_choices[0].first_token_logprobs: required when sampling.logprobs is set"),
        ([_start(256)], "other_choices[0].first_token_id: 256 is outside the vocabulary [0, 256)"),
    ]  # fmt: skip
    for i, (others, message) in enumerate(refusals):
        ticket, first = stack.ready(f"bad{i}", PROMPT)
        request = stack.generate_request(
            ticket, first, sampling=SEEDED, first_token_logprobs=_reported(first),
            other_choices=others,
        )  # fmt: skip
        call = lambda r=request: list(stack.stub.Generate(r, timeout=30))  # noqa: E731
        assert rpc_failure(call) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert rpc_failure(call) == (grpc.StatusCode.ABORTED, f"bad request: {message}")
