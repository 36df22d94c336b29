"""The real tandem.v1.DecodeService (decode.service.DecodeServicer) over gRPC, on a tiny engine
with random weights on the CPU.

An in-process "prefill" (an engine with the same weights) runs each prompt and copies its KV
into the ticket's blocks, as a transport would; the decoded tokens must equal one engine doing
the whole request. An Abort takes effect in every state of a request, the window between
Generate's hand-over and the engine thread admitting the sequence included (reproduced by
holding the engine thread at its next step). Every test ends with the pool all free and no
request live.
"""

from __future__ import annotations

import time

import grpc
import torch

from decode.tests.stack import BLOCK, BLOCKS, NEW_TOKENS, Context, Stack, layout, rpc_failure
from engine.sampling import SAMPLING_FIELDS
from proto.tandem.v1 import decode_pb2

torch.set_num_threads(1)

PROMPTS = [[1, 17, 99, 3, 250, 41, 7], list(range(10, 50)), [1, 200, 201, 202, 203]]
STATS = decode_pb2.StatsRequest()


def _tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_sampling_fields_are_the_protos():
    fields = decode_pb2.SamplingParams.DESCRIPTOR.fields
    assert tuple(f.name for f in fields) == SAMPLING_FIELDS


def test_hello_answers_the_layout_or_refuses_naming_both_values(stack):
    hello = decode_pb2.HelloRequest(sender_layout=layout(), sender_id="p0")
    reply = stack.stub.Hello(hello, timeout=10)
    assert reply.decode_layout == layout()
    assert [e.metadata for e in reply.endpoints] == [b"127.0.0.1:1"]
    bad = decode_pb2.HelloRequest(sender_layout=layout(3, "bfloat16"), sender_id="p1")
    code, details = rpc_failure(lambda: stack.stub.Hello(bad, timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == (
        "sender p1 cannot write here: num_layers: decode has 2, sender has 3; "
        "kv_dtype: decode has 'float32', sender has 'bfloat16'"
    )
    # A TP 2 sender whose head ranges overlap instead of splitting the 2 KV heads.
    overlapping = layout()
    overlapping.tp_size = 2
    del overlapping.head_ranges[:]
    overlapping.head_ranges.add(start=0, end=2)
    overlapping.head_ranges.add(start=1, end=2)
    hello = decode_pb2.HelloRequest(sender_layout=overlapping, sender_id="p2")
    code, details = rpc_failure(lambda: stack.stub.Hello(hello, timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == (
        "sender p2 cannot write here: head_ranges: sender's [(0, 2), (1, 2)] (tp_size 2) do not "
        "split [0, 2) into one range per rank"
    )


def test_reserve_returns_a_ticket_into_the_engine_cache(stack):
    ticket = stack.reserve("r", PROMPTS[1], num_senders=2)
    assert (ticket.request_id, ticket.generation, ticket.num_tokens) == ("r", 1, 40)
    assert list(ticket.block_ids) == [0, 1, 2] and ticket.num_senders == 2
    cache = stack.engine.kv_cache
    [shard] = ticket.shards
    assert [layer.k.addr for layer in shard.layers] == [r.k_ptr for r in cache.layer_regions()]
    assert ticket.block_stride_bytes == cache.block_stride_bytes and ticket.layout == layout()
    assert stack.abort("r", ticket_undelivered=True)


def test_reserve_refusals_name_the_values(stack):
    code, details = rpc_failure(lambda: stack.reserve("big", [5] * (BLOCKS * BLOCK)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "prompt of 384 tokens + max_tokens 10 exceeds the context length 384"
    stack.reserve("a", [5] * 300)
    code, details = rpc_failure(lambda: stack.reserve("b", [5] * 100))
    assert (code, details) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "7 KV blocks needed for 100 tokens, 5 free of 24",
    )
    code, _ = rpc_failure(lambda: stack.reserve("a", [5]))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert stack.abort("a", ticket_undelivered=True)


def test_tokens_equal_one_engine_doing_the_whole_request(stack):
    for i, prompt in enumerate(PROMPTS):
        ticket, first = stack.ready(f"r{i}", prompt)
        messages = list(stack.generate(ticket, first))
        assert _tokens(messages) == stack.prefill.reference(prompt)
        assert not any(m.logprobs for m in messages)  # not asked for
        assert messages[-1].finish_reason in (
            decode_pb2.FINISH_REASON_LENGTH,
            decode_pb2.FINISH_REASON_STOP,
        )
        assert messages[-1].usage.prompt_tokens == len(prompt)
        # Finished, and forgotten: a second Generate finds nothing.
        code, _ = rpc_failure(lambda t=ticket, f=first: list(stack.generate(t, f)))
        assert code == grpc.StatusCode.NOT_FOUND


def test_a_stale_generation_is_refused_and_changes_nothing(stack):
    old = stack.reserve("again", PROMPTS[0])
    assert stack.abort("again", reason="retry")
    new = stack.reserve("again", PROMPTS[0])
    assert new.generation == old.generation + 1
    code, _ = rpc_failure(lambda: stack.commit(old))  # also ends the old one's quarantine
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = rpc_failure(lambda: list(stack.generate(old, 5)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    first = stack.prefill.write(new, PROMPTS[0])
    reply = stack.commit(new)
    assert (reply.committed_senders, reply.expected_senders) == (1, 1)
    assert stack.commit(new) == reply  # a repeated commit is harmless
    assert _tokens(stack.generate(new, first)) == stack.prefill.reference(PROMPTS[0])


def test_missed_deadline_and_bad_sampling_end_with_their_status(stack):
    late = stack.reserve("late", PROMPTS[0], transfer_timeout_ms=100)
    code, details = rpc_failure(lambda: list(stack.generate(late, 5)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert details == (
        "not every sender committed by the deadline: 0 of an unknown number (no commit named "
        "it) (committed ranks: [])"
    )
    code, _ = rpc_failure(lambda: stack.commit(late))  # the late sender learns it failed
    assert code == grpc.StatusCode.FAILED_PRECONDITION

    ticket, first = stack.ready("bad", PROMPTS[0])
    bad = decode_pb2.SamplingParams(top_p=0.0)
    code, details = rpc_failure(lambda: list(stack.generate(ticket, first, sampling=bad)))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "top_p: 0.0 is not in (0, 1]")
    code, details = rpc_failure(lambda: list(stack.generate(ticket, first)))
    assert (code, details) == (grpc.StatusCode.ABORTED, "bad request: top_p: 0.0 is not in (0, 1]")


def test_logprobs_come_one_per_token_the_first_as_the_prefill_reported(stack):
    """Read slowly, so that messages carry several tokens: each keeps one entry per token."""
    ticket, first = stack.ready("lp", PROMPTS[0])
    reported = decode_pb2.TokenLogprobs(
        logprob=-0.25, top_token_ids=[first, 7], top_logprobs=[-0.25, -2.0]
    )
    request = stack.generate_request(
        ticket, first, ignore_eos=True, sampling=decode_pb2.SamplingParams(logprobs=2),
        first_token_logprobs=reported,
    )  # fmt: skip
    stream = stack.servicer.Generate(request, Context())
    messages = [next(stream)]
    deadline = time.monotonic() + 10
    while stack.admission.num_live and time.monotonic() < deadline:
        time.sleep(0.01)  # the rest is generated while nobody reads (live until the last)
    messages += list(stream)
    assert any(len(m.token_ids) > 1 for m in messages)
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    tokens, logprobs = _tokens(messages), [lp for m in messages for lp in m.logprobs]
    assert len(tokens) == NEW_TOKENS and logprobs[0] == reported
    for token, lp in zip(tokens[1:], logprobs[1:], strict=True):
        assert lp.top_token_ids[0] == token  # greedy: the most likely
        assert len(lp.top_logprobs) == 2 and lp.logprob == lp.top_logprobs[0] < 0


def test_logprobs_without_the_first_tokens_are_refused(stack):
    ticket, first = stack.ready("no-first", PROMPTS[0])
    sampling = decode_pb2.SamplingParams(logprobs=2)
    code, details = rpc_failure(lambda: list(stack.generate(ticket, first, sampling=sampling)))
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "first_token_logprobs: required when sampling.logprobs is set",
    )


def test_structured_output_without_a_kind_or_a_tokenizer_is_refused(stack):
    """The tiny random model has no tokenizer, which xgrammar needs (the positive paths are in
    structured_output_test.py, with a real tokenizer)."""
    refusals = [
        (decode_pb2.StructuredOutput(compact_whitespace=True),
         "structured_output: names no kind (json_schema, json_object, regex or grammar)"),
        (decode_pb2.StructuredOutput(json_object=False),
         "structured_output: json_object: must be true when set"),
        (decode_pb2.StructuredOutput(regex="[0-9]+"),
         "structured_output: needs the model's tokenizer, and random:tiny has none"),
    ]  # fmt: skip
    for i, (constraint, message) in enumerate(refusals):
        ticket, first = stack.ready(f"so{i}", PROMPTS[0])
        call = lambda t=ticket, f=first, c=constraint: list(  # noqa: E731
            stack.generate(t, f, structured_output=c)
        )
        assert rpc_failure(call) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert rpc_failure(call) == (grpc.StatusCode.ABORTED, f"bad request: {message}")


def _busy(stack: Stack, request_id: str):
    """A request decoding (for up to 300 tokens), admitted by the engine thread: its first
    message (the prefill's token, sent before admission) and the engine's next one read."""
    ticket, first = stack.ready(request_id, PROMPTS[1])
    stream = stack.generate(ticket, first, ignore_eos=True, max_tokens=300)
    assert next(stream).token_ids[0] == first
    assert next(stream).token_ids
    return stream


def test_abort_takes_effect_in_every_state(stack):
    # RESERVED: the ticket fails; its sender may still write, so its block waits for it.
    reserved = stack.reserve("reserved", PROMPTS[0])
    assert stack.abort("reserved", reason="router gave up")
    assert stack.stub.Stats(STATS).kv_blocks_quarantined == 1
    code, details = rpc_failure(lambda: list(stack.generate(reserved, 5)))
    assert (code, details) == (grpc.StatusCode.ABORTED, "router gave up")
    code, details = rpc_failure(lambda: stack.commit(reserved))  # the sender stops: block freed
    assert (code, details) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "request 'reserved': router gave up",
    )
    # READY: the ticket fails; its blocks are free at once.
    ready, first = stack.ready("ready", PROMPTS[0])
    assert stack.abort("ready")
    code, details = rpc_failure(lambda: list(stack.generate(ready, first)))
    assert (code, details) == (grpc.StatusCode.ABORTED, "aborted by client")
    # RUNNING: held at a step, so that it cannot finish before the abort.
    stream = _busy(stack, "running")
    stack.engine.hold()
    assert stack.abort("running")
    stack.engine.release()
    rest = list(stream)
    assert rest[-1].finish_reason == decode_pb2.FINISH_REASON_ABORT
    # FINISHED, FAILED and unknown requests: nothing to abort.
    assert not stack.abort("running") and not stack.abort("ready")
    assert not stack.abort("nobody")


def test_an_abort_before_the_engine_thread_admits_the_sequence_stops_it(stack):
    """Admission has handed the request over; the engine thread, busy with a step, has not
    admitted it yet. The Abort must find it there and stop it before it decodes."""
    busy = _busy(stack, "busy")
    stack.engine.hold()
    ticket, first = stack.ready("late", PROMPTS[0])
    request = stack.generate_request(ticket, first, ignore_eos=True)
    generate, context, messages = stack.generate_directly(request)
    assert context.handed_over.wait(timeout=10)  # queued for the engine thread, held
    stats = stack.stub.Stats(STATS, timeout=10)
    assert (stats.running, stats.waiting, stats.reserved) == (1, 0, 0)  # only "busy" runs
    assert stats.max_model_len == stack.engine.max_model_len > 0
    assert 0 < stats.outstanding_tokens < 300
    assert stack.abort("late", reason="client gone")
    stack.engine.release()
    generate.join(timeout=10)
    assert _tokens(messages) == [first]  # the prefill's token, and no other
    assert messages[-1].finish_reason == decode_pb2.FINISH_REASON_ABORT
    assert messages[-1].usage.completion_tokens == 1
    assert stack.abort("busy")
    assert list(busy)[-1].finish_reason == decode_pb2.FINISH_REASON_ABORT


def test_first_tokens_stream_before_the_engine_thread_admits_them(stack):
    """The prefill's token goes out once Generate has handed the request over, while the engine
    thread is still busy with a step; a first token that ends its choice (max_tokens 1) is the
    engine's to send, with its finish reason. The rest equals one engine."""
    busy = _busy(stack, "busy")
    stack.engine.hold()
    ticket, first = stack.ready("early", PROMPTS[0])
    early, _, messages = stack.generate_directly(stack.generate_request(ticket, first))
    ticket, last = stack.ready("one", PROMPTS[2])
    one, one_context, ended = stack.generate_directly(
        stack.generate_request(ticket, last, max_tokens=1)
    )
    deadline = time.monotonic() + 10
    while not messages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert one_context.handed_over.wait(timeout=10)
    time.sleep(0.05)  # room for a wrong early message
    assert [list(m.token_ids) for m in messages] == [[first]]
    assert messages[0].finish_reason == decode_pb2.FINISH_REASON_UNSPECIFIED
    assert not ended
    assert stack.stub.Stats(STATS, timeout=10).running == 1  # neither admitted: only "busy"
    stack.engine.release()
    early.join(timeout=10)
    one.join(timeout=10)
    assert _tokens(messages) == stack.prefill.reference(PROMPTS[0])
    assert [list(m.token_ids) for m in ended] == [[last]]
    assert ended[0].finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert stack.abort("busy")
    assert list(busy)[-1].finish_reason == decode_pb2.FINISH_REASON_ABORT


def test_an_engine_failure_ends_every_request_with_unavailable():
    """The running request, and one handed over but not admitted yet, both end UNAVAILABLE
    naming the error; admission forgets both; the instance refuses work from then on."""
    stack = Stack()
    try:
        running = _busy(stack, "running")
        stack.engine.hold()
        ticket, first = stack.ready("queued", PROMPTS[0])
        generate, context, queued = stack.generate_directly(stack.generate_request(ticket, first))
        assert context.handed_over.wait(timeout=10)
        stack.engine.fail_with = RuntimeError("CUDA error: an illegal memory access")
        stack.engine.release()
        code, details = rpc_failure(lambda: list(running))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "RuntimeError: CUDA error: an illegal memory access" in details
        assert "restart the decode server" in details
        generate.join(timeout=10)
        assert queued[-1].args == (grpc.StatusCode.UNAVAILABLE, stack.loop.failure)
        assert stack.admission.num_live == 0
        for refused in (
            lambda: stack.stub.Stats(STATS, timeout=10),
            lambda: stack.reserve("after", PROMPTS[0]),
        ):
            assert rpc_failure(refused) == (grpc.StatusCode.UNAVAILABLE, stack.loop.failure)
    finally:
        stack.close()
