"""Token ids to OpenAI responses: stop strings cut the text (even across token boundaries) and
close the upstream stream, logprobs travel with the text they cover, and the SSE and
non-streaming bodies are exactly what clients get."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from engine.openai_logprobs import token_texts
from proto.tandem.v1 import decode_pb2
from router.choice_streams import batched, echoed
from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError
from router.generation import Finished, PromptLogprobs, Tokens
from router.logprobs import LogprobsFormat
from router.requests import Endpoint
from router.streaming import (
    ChoiceText,
    Delta,
    Response,
    collect,
    completion_body,
    sse,
    text_events,
)
from router.tests.fakes import CharTokenizer, ids

COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT


class Upstream:
    """Token lists, then a Finished (or an error); records whether it was closed early."""

    def __init__(
        self, pieces: list[str], finish: Finished | BackendError, logprobs: bool = False
    ) -> None:
        self.pieces = pieces
        self.finish = finish
        self.logprobs = logprobs
        """Each token's logprob: minus its code point / 1024 (exact in float32), its one
        alternative "?"."""
        self.closed_early = False

    async def stream(self):
        try:
            for piece in self.pieces:
                yield Tokens(ids(piece), [_logprob(t) for t in ids(piece)] if self.logprobs else [])
        except GeneratorExit:
            self.closed_early = True
            raise
        if isinstance(self.finish, BackendError):
            raise self.finish
        yield self.finish


def _logprob(token_id: int) -> decode_pb2.TokenLogprobs:
    return decode_pb2.TokenLogprobs(logprob=-token_id / 1024, top_token_ids=[ord("?")],
                                    top_logprobs=[-0.5])  # fmt: skip


async def _list(iterator) -> list:
    return [item async for item in iterator]


def _text(stream, prompt_tokens: int, stops=(), include_stop=False, choices: int = 1, stop=None):
    """text_events over `stream` for `choices` choices, each with its own detokenizer."""
    texts = [ChoiceText(i, IncrementalDetokenizer(CharTokenizer(), ids("why?")), prompt_tokens,
                        stops, include_stop) for i in range(choices)]  # fmt: skip
    return text_events(stream, texts, stop)


def _events(upstream: Upstream, stops=(), prompt_tokens: int = 4) -> list:
    return asyncio.run(_list(_text(upstream.stream(), prompt_tokens, stops)))


def test_text_then_a_finished_with_the_routers_own_token_counts():
    upstream = Upstream(["Hel", "lo"], Finished("length", 99, 99))
    assert _events(upstream) == [Delta("Hel", ids("Hel")), Delta("lo", ids("lo")),
                                 Finished("length", 4, 5)]  # fmt: skip
    assert not upstream.closed_early


def test_a_stop_string_across_tokens_ends_the_text_and_closes_upstream():
    upstream = Upstream(["The ", "ans", "wer", " is"], Finished("length", 0, 0))
    events = _events(upstream, stops=["swe", "zzz"])
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "The an"
    assert events[-1] == Finished("stop", 4, 10)  # the tokens consumed, up to the stop string
    assert upstream.closed_early  # the decode server is told to stop


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    upstream = Upstream(["ab", "c", "d"], Finished("stop", 0, 0))
    texts = [Delta("a", ids("ab")), Delta("b", ids("c")), Delta("c", ids("d")), Delta("d")]
    assert _events(upstream, stops=["cX"]) == [*texts, Finished("stop", 4, 4)]


def test_the_stop_string_is_kept_when_asked():
    upstream = Upstream(["The ", "ans", "wer", " is"], Finished("length", 0, 0))
    events = asyncio.run(_list(_text(upstream.stream(), 4, ["swe"], True)))
    assert "".join(e.text for e in events if isinstance(e, Delta)) == "The answe"


def test_logprobs_ride_with_the_text_that_covers_their_tokens():
    upstream = Upstream(["ab", "c", "d"], Finished("length", 0, 0), logprobs=True)
    events = _events(upstream, stops=["cX"])  # one character is held: it may start "cX"
    covered = [(e.text, [t for t, _ in e.logprobs]) for e in events if isinstance(e, Delta)]
    assert covered == [("a", ids("ab")), ("b", ids("c")), ("c", ids("d")), ("d", [])]
    assert events[0].logprobs[1][1] == _logprob(ord("b"))


def _response(endpoint: Endpoint, include_usage: bool = False, logprobs: bool = False):
    fmt = (LogprobsFormat(token_texts(CharTokenizer()), endpoint is CHAT),) if logprobs else ()
    return Response(endpoint, "id-1", "tiny", 1700, include_usage, fmt)


def _sse(upstream: Upstream, endpoint: Endpoint, include_usage: bool) -> list:
    events = _text(upstream.stream(), 3)
    response = _response(endpoint, include_usage, upstream.logprobs)
    lines = asyncio.run(_list(sse(events, response)))
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_completion_chunks():
    chunks = _sse(Upstream(["Hi", "!"], Finished("length", 0, 0)), COMPLETIONS, False)
    head = {"id": "id-1", "object": "text_completion", "created": 1700, "model": "tiny"}
    choice = {"index": 0, "logprobs": None, "finish_reason": None}
    assert chunks == [
        {**head, "choices": [{**choice, "text": "Hi"}]},
        {**head, "choices": [{**choice, "text": "!"}]},
        {**head, "choices": [{**choice, "text": "", "finish_reason": "length"}]},
    ]


def test_token_ids_where_vllms_return_token_ids_puts_them():
    """Completions: each choice's prompt ids on its first chunk and in its body; chat: the
    prompt's on the response's first chunk and in its body; every choice's own ids."""
    prompt = ids("why")

    def run(endpoint: Endpoint, stream: bool):
        upstream = Upstream(["Hi", "!"], Finished("length", 0, 0))
        events = _text(upstream.stream(), 3)
        response = dataclasses.replace(_response(endpoint), prompt_token_ids=(prompt,))
        if stream:
            return [json.loads(line[6:]) for line in asyncio.run(_list(sse(events, response)))[:-1]]
        return completion_body(response, asyncio.run(collect(events)))

    chunks = run(COMPLETIONS, stream=True)
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks] == [prompt, None, None]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [ids("Hi"), ids("!"), []]
    [choice] = run(COMPLETIONS, stream=False)["choices"]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt, ids("Hi!"))
    chunks = run(CHAT, stream=True)
    assert [c.get("prompt_token_ids") for c in chunks] == [prompt, None, None]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [ids("Hi"), ids("!"), []]
    body = run(CHAT, stream=False)
    assert body["prompt_token_ids"] == prompt and body["choices"][0]["token_ids"] == ids("Hi!")
    events = _text(Upstream(["Hi"], Finished("length", 0, 0)).stream(), 3)
    plain = completion_body(_response(CHAT), asyncio.run(collect(events)))  # not asked: none
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_a_chats_echo_starts_each_choices_content_in_a_body_and_a_stream():
    response = dataclasses.replace(_response(CHAT), chat_echo="Once ")
    events = _text(Upstream(["Hi", "!"], Finished("length", 0, 0)).stream(), 3)
    [choice] = completion_body(response, asyncio.run(collect(events)))["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Once Hi!"}
    events = _text(Upstream(["Hi", "!"], Finished("length", 0, 0)).stream(), 3)
    chunks = [json.loads(line[6:]) for line in asyncio.run(_list(sse(events, response)))[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "Once "}, {"content": "Hi"}, {"content": "!"},
        {"content": ""},
    ]  # fmt: skip


def test_chat_chunks_name_the_role_first_and_end_with_usage_when_asked():
    chunks = _sse(Upstream(["Hi", "!"], Finished("stop", 0, 0)), CHAT, True)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": "Hi"},
        {"content": "!"},
        {"content": ""},
    ]
    assert {c["choices"][0]["logprobs"] for c in chunks[:3]} == {None}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "stop"]
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == usage and len(chunks) == 4


def test_a_backend_error_mid_stream_ends_it_with_an_error_event():
    upstream = Upstream(["Hi"], BackendError(503, "decode server d0: socket closed"))
    chunks = _sse(upstream, COMPLETIONS, True)
    assert chunks[0]["choices"][0]["text"] == "Hi"
    error = {"message": "decode server d0: socket closed", "type": "server_error",
             "param": None, "code": 503}  # fmt: skip
    assert chunks[1:] == [{"error": error}]


def test_collect_and_the_whole_bodies():
    events = _text(Upstream(["Hi", "!"], Finished("length", 0, 0)).stream(), 2)
    [(whole, finish)] = choices = asyncio.run(collect(events))
    assert (whole, finish) == (Delta("Hi!", ids("Hi!")), Finished("length", 2, 3))
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    head = {"id": "id-1", "created": 1700, "model": "tiny", "usage": usage}
    assert completion_body(_response(COMPLETIONS), choices) == {
        **head, "object": "text_completion",
        "choices": [{"index": 0, "text": "Hi!", "logprobs": None, "finish_reason": "length"}],
    }  # fmt: skip
    message = {"role": "assistant", "content": "Hi!"}
    assert completion_body(_response(CHAT), choices) == {
        **head, "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "length"}],
    }  # fmt: skip


def test_logprobs_in_chat_and_completions_shapes():
    upstream = Upstream(["Hi"], Finished("length", 0, 0), logprobs=True)
    choices = asyncio.run(collect(_text(upstream.stream(), 2)))
    chat = completion_body(_response(CHAT, logprobs=True), choices)["choices"][0]
    question = {"token": "?", "logprob": -0.5, "bytes": [63]}
    assert chat["logprobs"] == {"content": [
        {"token": "H", "logprob": -72 / 1024, "bytes": [72], "top_logprobs": [question]},
        {"token": "i", "logprob": -105 / 1024, "bytes": [105], "top_logprobs": [question]},
    ]}  # fmt: skip
    text = completion_body(_response(COMPLETIONS, logprobs=True), choices)["choices"][0]
    assert text["logprobs"] == {
        "tokens": ["H", "i"], "token_logprobs": [-72 / 1024, -105 / 1024],
        "top_logprobs": [{"?": -0.5, "H": -72 / 1024}, {"?": -0.5, "i": -105 / 1024}],
        "text_offset": [0, 1],
    }  # fmt: skip


def _with_prompt(prompt: str):
    """The prompt's log-probabilities (each token's `_logprob`, ranked 2nd), then "Hi"."""
    entries = [_logprob(t) for t in ids(prompt)[1:]]
    for entry in entries:
        entry.rank = 2
    yield PromptLogprobs(ids(prompt), entries, 0)
    yield Tokens(ids("Hi"), [_logprob(t) for t in ids("Hi")])
    yield Finished("length", 0, 0)


async def _prompt_then(prompt: str):
    for item in _with_prompt(prompt):
        yield item


@pytest.mark.parametrize("prompt_only", [False, True])
def test_an_echo_with_logprobs_starts_with_the_prompts_and_the_body_names_them(prompt_only):
    events = echoed(_text(_prompt_then("abc"), 3), ["abc"], 1, prompt_only)
    choices = asyncio.run(collect(events))
    token_text = token_texts(CharTokenizer())
    response = dataclasses.replace(_response(COMPLETIONS, logprobs=True), token_text=token_text)
    [choice] = completion_body(response, choices)["choices"]
    generated = "" if prompt_only else "Hi"
    assert choice["text"] == "abc" + generated
    lp = choice["logprobs"]
    assert lp["tokens"] == list("abc" + generated)
    assert lp["text_offset"] == list(range(len(lp["tokens"])))
    scored = [-t / 1024 for t in ids("bc" + generated)]
    assert lp["token_logprobs"] == [None, *scored]
    assert lp["top_logprobs"][:3] == [None, {"b": -98 / 1024, "?": -0.5},
                                      {"c": -99 / 1024, "?": -0.5}]  # fmt: skip
    question = {"logprob": -0.5, "rank": 1, "decoded_token": "?"}
    assert choice["prompt_logprobs"] == [
        None,
        {"98": {"logprob": -98 / 1024, "rank": 2, "decoded_token": "b"}, "63": question},
        {"99": {"logprob": -99 / 1024, "rank": 2, "decoded_token": "c"}, "63": question},
    ]  # fmt: skip
    chat = dataclasses.replace(response, endpoint=CHAT, logprobs=())
    body = completion_body(chat, asyncio.run(collect(_text(_prompt_then("abc"), 3))))
    assert body["prompt_logprobs"] == choice["prompt_logprobs"]
    assert "prompt_logprobs" not in body["choices"][0]


def test_streamed_logprobs_come_with_their_chunks():
    chunks = _sse(Upstream(["Hi", "!"], Finished("length", 0, 0), logprobs=True), COMPLETIONS,
                  False)  # fmt: skip
    assert [c["choices"][0]["logprobs"] and c["choices"][0]["logprobs"]["tokens"]
            for c in chunks] == [["H", "i"], ["!"], None]  # fmt: skip
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [2]  # runs on across chunks


def test_the_stop_token_that_ended_the_generation_adds_no_text_unless_asked():
    async def upstream():
        yield Tokens(ids("Hi"))
        yield Tokens(ids("!#"), ends_on_stop_token=True)  # "#": the end-of-sequence token
        yield Finished("stop", 0, 4)

    for include_stop, text in ((False, "Hi!"), (True, "Hi!#")):
        events = asyncio.run(_list(_text(upstream(), 1, (), include_stop)))
        assert "".join(e.text for e in events if isinstance(e, Delta)) == text
        assert events[-1] == Finished("stop", 1, 4)  # the stop token counts


class TwoChoices:
    """Choice 0 says "Hi!" then "Bye", choice 1 says "Ho" then "stop here", interleaved; records
    the choices stopped upstream and whether the stream was closed."""

    def __init__(self) -> None:
        self.stopped: list[int] = []
        self.closed = False

    async def stream(self):
        try:
            yield Tokens(ids("Hi!"), index=0)
            yield Tokens(ids("Ho"), index=1)
            yield Tokens(ids("stop here"), index=1)
            yield Tokens(ids("Bye"), index=0)
            yield Tokens(ids("more"), index=1)  # sent before the decode server heard the stop
            yield Finished("length", 0, 6, index=0)
            yield Finished("abort", 0, 15, index=1)
        finally:
            self.closed = True

    async def stop(self, index: int) -> None:
        self.stopped.append(index)


def test_each_choice_has_its_own_text_stop_strings_and_finish():
    upstream = TwoChoices()
    events = asyncio.run(_list(_text(upstream.stream(), 2, [" here"], choices=2,
                                     stop=upstream.stop)))  # fmt: skip
    texts = {i: "".join(e.text for e in events if isinstance(e, Delta) and e.index == i)
             for i in (0, 1)}  # fmt: skip
    assert texts == {0: "Hi!Bye", 1: "Hostop"}
    finished = [e for e in events if isinstance(e, Finished)]
    assert finished == [Finished("stop", 2, 11, 1), Finished("length", 2, 6, 0)]
    assert upstream.stopped == [1]  # once, as soon as its stop string showed
    assert upstream.closed


def test_two_choices_stream_with_their_indexes_and_one_usage():
    upstream = TwoChoices()
    events = _text(upstream.stream(), 2, [" here"], choices=2, stop=upstream.stop)
    response = Response(CHAT, "id-1", "tiny", 1700, include_usage=True, n=2)
    lines = asyncio.run(_list(sse(events, response)))
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:-1]]
    # Text that may start " here" is held back: choice 0 shows nothing until "Bye".
    assert deltas == [(1, {"role": "assistant", "content": "Hostop"}), (1, {"content": ""}),
                      (0, {"role": "assistant", "content": "Hi"}), (0, {"content": "!Bye"}),
                      (0, {"content": ""})]  # fmt: skip
    ends = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert [end for end in ends if end[1]] == [(1, "stop"), (0, "length")]
    usage = {"prompt_tokens": 2, "completion_tokens": 17, "total_tokens": 19}
    assert chunks[-1] == {**response.head(chunk=True), "choices": [], "usage": usage}


def test_the_whole_body_lists_the_choices_in_order():
    upstream = TwoChoices()
    events = _text(upstream.stream(), 2, [" here"], choices=2, stop=upstream.stop)
    response = Response(COMPLETIONS, "id-1", "tiny", 1700, n=2)
    body = completion_body(response, asyncio.run(collect(events)))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hi!Bye", "length"), (1, "Hostop", "stop")]  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 17, "total_tokens": 19}


def test_a_one_choice_response_carries_its_speculative_decoding_as_vllm_does():
    """vLLM's per-request summary (--per-request-spec-decode-metrics summary): the body's
    `metrics`, the usage chunk's when streamed; from the decode server's histogram."""
    stats = decode_pb2.SpecDecodeStats(acceptance_histogram=[1, 0, 2, 1], num_draft_tokens=12)
    finish = Finished("length", 0, 0, spec_decode=stats)
    spec = {
        "mean_acceptance_length": 1 + 7 / 4, "draft_acceptance_rate": 7 / 12,
        "acceptance_histogram": [1, 0, 2, 1], "num_spec_steps": 4,
        "num_accepted_draft_tokens": 7, "num_draft_tokens": 12, "num_spec_tokens": 3,
    }  # fmt: skip
    on = Response(CHAT, "id-1", "tiny", 1700, include_usage=True, spec_metrics=True)
    choices = asyncio.run(collect(_text(Upstream(["Hi"], finish).stream(), 2)))
    assert completion_body(on, choices)["metrics"] == {"speculative_decoding": spec}
    lines = asyncio.run(_list(sse(_text(Upstream(["Hi"], finish).stream(), 2), on)))
    usage_chunk = json.loads(lines[-2][len("data: ") :])
    assert usage_chunk["choices"] == [] and usage_chunk["metrics"]["speculative_decoding"] == spec
    off = Response(CHAT, "id-1", "tiny", 1700)  # the router's default, as vLLM's
    assert "metrics" not in completion_body(off, choices)
    second = (Delta("Ho", ids("Ho"), [], 1), dataclasses.replace(finish, index=1))
    assert "metrics" not in completion_body(on, [*choices, second])  # n > 1: none


def test_a_batch_renumbers_each_prompts_choices_and_one_failing_closes_the_others():
    closed = []

    async def prompt(name: str, fail: bool = False, stall: bool = False):
        try:
            for index in (0, 1):
                yield Delta(name, index=index)
                await asyncio.sleep(0)
            if fail:
                raise BackendError(503, f"{name} failed")
            if stall:
                await asyncio.Event().wait()
            yield Finished("length", 3, 1, 1)
        finally:
            closed.append(name)

    events = asyncio.run(_list(batched([prompt("a"), prompt("b")], 2)))
    assert sorted((e.index, e.text) for e in events if isinstance(e, Delta)) == [
        (0, "a"), (1, "a"), (2, "b"), (3, "b")]  # fmt: skip
    assert sorted(e.index for e in events if isinstance(e, Finished)) == [1, 3]
    closed.clear()
    with pytest.raises(BackendError, match="b failed"):
        asyncio.run(_list(batched([prompt("a", stall=True), prompt("b", fail=True)], 2)))
    assert sorted(closed) == ["a", "b"]  # the stalled one closed: its generation aborted
