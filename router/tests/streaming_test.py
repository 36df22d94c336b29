"""Token ids to OpenAI responses: stop strings cut the text (even across token boundaries) and
close the upstream stream, and the SSE and non-streaming bodies are exactly what clients get."""

from __future__ import annotations

import asyncio
import json

from router.detokenizer import IncrementalDetokenizer
from router.errors import BackendError
from router.generation import Finished
from router.requests import Endpoint
from router.streaming import collect, completion_body, sse, text_events
from router.tests.fakes import CharTokenizer, ids

COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT


class Upstream:
    """Token lists, then a Finished (or an error); records whether it was closed early."""

    def __init__(self, pieces: list[str], finish: Finished | BackendError) -> None:
        self.pieces = pieces
        self.finish = finish
        self.closed_early = False

    async def stream(self):
        try:
            for piece in self.pieces:
                yield ids(piece)
        except GeneratorExit:
            self.closed_early = True
            raise
        if isinstance(self.finish, BackendError):
            raise self.finish
        yield self.finish


async def _list(iterator) -> list:
    return [item async for item in iterator]


def _events(upstream: Upstream, stops=(), prompt_tokens: int = 4) -> list:
    detok = IncrementalDetokenizer(CharTokenizer(), ids("why?"))
    return asyncio.run(_list(text_events(upstream.stream(), detok, prompt_tokens, stops)))


def test_text_then_a_finished_with_the_routers_own_token_counts():
    upstream = Upstream(["Hel", "lo"], Finished("length", 99, 99))
    assert _events(upstream) == ["Hel", "lo", Finished("length", 4, 5)]
    assert not upstream.closed_early


def test_a_stop_string_across_tokens_ends_the_text_and_closes_upstream():
    upstream = Upstream(["The ", "ans", "wer", " is"], Finished("length", 0, 0))
    events = _events(upstream, stops=["swe", "zzz"])
    assert "".join(e for e in events if isinstance(e, str)) == "The an"
    assert events[-1] == Finished("stop", 4, 10)  # the tokens consumed, up to the stop string
    assert upstream.closed_early  # the decode server is told to stop


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    upstream = Upstream(["ab", "c", "d"], Finished("stop", 0, 0))
    assert _events(upstream, stops=["cX"]) == ["a", "b", "c", "d", Finished("stop", 4, 4)]


def _sse(upstream: Upstream, endpoint: Endpoint, include_usage: bool) -> list:
    events = text_events(upstream.stream(), IncrementalDetokenizer(CharTokenizer()), 3, ())
    lines = asyncio.run(_list(sse(events, endpoint, "id-1", "tiny", 1700, include_usage)))
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


def test_chat_chunks_name_the_role_first_and_end_with_usage_when_asked():
    chunks = _sse(Upstream(["Hi", "!"], Finished("stop", 0, 0)), CHAT, True)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": "Hi"},
        {"content": "!"},
        {"content": ""},
    ]
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
    events = text_events(Upstream(["Hi", "!"], Finished("length", 0, 0)).stream(),
                         IncrementalDetokenizer(CharTokenizer()), 2, ())  # fmt: skip
    text, finish = asyncio.run(collect(events))
    assert (text, finish) == ("Hi!", Finished("length", 2, 3))
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    head = {"id": "id-1", "created": 1700, "model": "tiny", "usage": usage}
    assert completion_body(COMPLETIONS, "id-1", "tiny", 1700, text, finish) == {
        **head, "object": "text_completion",
        "choices": [{"index": 0, "text": "Hi!", "logprobs": None, "finish_reason": "length"}],
    }  # fmt: skip
    message = {"role": "assistant", "content": "Hi!"}
    assert completion_body(CHAT, "id-1", "tiny", 1700, text, finish) == {
        **head, "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
    }  # fmt: skip
