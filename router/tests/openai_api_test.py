"""The HTTP API in-process (httpx's ASGI transport) over FakePrefill, FakeDecode and a
one-token-per-character tokenizer: what a client sees for success, bad input, backend failures
before and during a stream, the 429 limit, the API key, and the metrics."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import httpx

from proto.tandem.v1 import decode_pb2
from router.openai_api import ClientGone, _unless_client_leaves
from router.tests.fakes import D0, MODEL, P0, CharTokenizer, Router, answer, ids, rpc_error

COMPLETION = {"model": MODEL, "prompt": "Capital?", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Capital?"}], "max_tokens": 8}


def _run(test, **router_args) -> Router:
    router = Router(**router_args)
    asyncio.run(test(router))
    assert router.decode.live() == set()
    assert all(d.outstanding_tokens == 0 for d in router.orchestrator.decodes)
    return router


def _sse(reply: httpx.Response) -> list:
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_a_completion_with_the_request_id_echoed():
    async def test(router: Router):
        reply = await router.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "t-1"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "t-1"
        body = reply.json()
        assert body["id"] == "cmpl-t-1" and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == "Paris"
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}
        # vLLM's body field names it where no header does.
        named = {**COMPLETION, "request_id": "b-2"}
        reply = await router.post("/v1/completions", named)
        assert reply.headers["x-request-id"] == "b-2" and reply.json()["id"] == "cmpl-b-2"
        reply = await router.post("/v1/completions", named, headers={"X-Request-Id": "t-3"})
        assert reply.headers["x-request-id"] == "t-3" and reply.json()["id"] == "cmpl-t-3"

    _run(test)


def test_prompts_are_tokenized_off_the_event_loop():
    """Tokenizing a long prompt (a 300k-token context: about half a second) must not stall the
    streams the router is sending: completions and chat prompts are tokenized, and chat
    templates rendered, on another thread than the event loop's."""
    callers = []

    class Recording(CharTokenizer):
        def __call__(self, text, add_special_tokens=True):
            callers.append(threading.get_ident())
            return super().__call__(text, add_special_tokens)

        def apply_chat_template(self, messages, **kwargs):
            callers.append(threading.get_ident())
            return super().apply_chat_template(messages, **kwargs)

    async def test(router: Router):
        router.prompts.local.tokenizer = Recording()
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            reply = await router.post(path, body)
            assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] > 0
        assert len(callers) >= 3 and threading.get_ident() not in callers

    _run(test)


def test_a_streamed_chat_with_usage():
    async def test(router: Router):
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        chunks = _sse(await router.post("/v1/chat/completions", body))
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content", "") for d in deltas) == "Paris"
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"][:9] == "chatcmpl-"

    _run(test)


def test_a_stop_string_ends_the_text_and_aborts_the_decode():
    async def test(router: Router):
        reply = await router.post("/v1/completions", {**COMPLETION, "stop": "ri"})
        assert reply.json()["choices"][0] | {"index": 0} == {
            "index": 0, "text": "Pa", "logprobs": None, "finish_reason": "stop"
        }  # fmt: skip
        assert [a.reason for a in router.decode.aborts()] == ["client gone"]

    _run(test)


def test_n_choices_each_with_its_index_streamed_or_not():
    async def test(router: Router):
        body = (
            await router.post("/v1/completions", {**COMPLETION, "n": 2, "temperature": 1})
        ).json()
        assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "Paris"), (1, "Paris")]
        assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 10, "total_tokens": 18}
        assert router.prefill.prefilled[-1].n == 2  # one prefill for both
        stream = {**CHAT, "n": 2, "temperature": 1, "stream": True, "stop": "ri",
                  "stream_options": {"include_usage": True}}  # fmt: skip
        chunks = _sse(await router.post("/v1/chat/completions", stream))
        texts = {0: "", 1: ""}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            texts[choice["index"]] += choice["delta"].get("content", "")
        assert texts == {0: "Pa", 1: "Pa"}
        assert chunks[-1]["usage"]["completion_tokens"] == 10  # "Paris" consumed by each
        # Choice 0 is stopped alone when its stop string shows; the rest once both have.
        assert [list(a.choices) for a in router.decode.aborts()] == [[0], []]

    _run(test)


def test_a_batch_of_prompts_answers_each_ones_choices_in_order_streamed_or_not():
    """Choice j of prompt i is choice i * n + j (vLLM's); the usage counts each prompt once."""

    async def test(router: Router):
        batch = {**COMPLETION, "prompt": ["Capital?", "Of Peru?"], "n": 2, "temperature": 1}
        body = (await router.post("/v1/completions", batch)).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert {c["text"] for c in body["choices"]} == {"Paris"}
        assert body["usage"] == {"prompt_tokens": 16, "completion_tokens": 20, "total_tokens": 36}
        prefilled = router.prefill.prefilled[-2:]  # one prefill of two choices a prompt
        assert sorted(p.prompt_ids for p in prefilled) == [ids("Capital?"), ids("Of Peru?")]
        assert [p.n for p in prefilled] == [2, 2]
        stream = {**batch, "stream": True, "stream_options": {"include_usage": True}}
        chunks = _sse(await router.post("/v1/completions", stream))
        texts: dict[int, str] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        assert texts == dict.fromkeys(range(4), "Paris")
        assert chunks[-1]["usage"]["prompt_tokens"] == 16
        token_ids = {**COMPLETION, "prompt": [[70, 71], [72, 73, 74]]}
        body = (await router.post("/v1/completions", token_ids)).json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["prompt_tokens"] == 5

    _run(test)


def test_echo_starts_each_choices_text_with_its_prompts_streamed_or_not():
    async def test(router: Router):
        echo = {**COMPLETION, "prompt": ["Capital?", "Of Peru?"], "echo": True}
        body = (await router.post("/v1/completions", echo)).json()
        assert [c["text"] for c in body["choices"]] == ["Capital?Paris", "Of Peru?Paris"]
        assert body["usage"]["completion_tokens"] == 10  # the prompts are no completion
        chunks = _sse(await router.post("/v1/completions", {**echo, "stream": True}))
        firsts: dict[int, str] = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            firsts.setdefault(choice["index"], choice["text"])
        assert firsts == {0: "Capital?", 1: "Of Peru?"}
        token_ids = {**echo, "prompt": [72, 105]}  # a token-id prompt echoes its text
        body = (await router.post("/v1/completions", token_ids)).json()
        assert body["choices"][0]["text"] == "HiParis"
        # A chat's: the last message, where the answer continues it (vLLM's), else nothing.
        start = {"role": "assistant", "content": "It is "}
        continued = {**CHAT, "messages": [*CHAT["messages"], start], "echo": True,
                     "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
        body = (await router.post("/v1/chat/completions", continued)).json()
        assert body["choices"][0]["message"]["content"] == "It is Paris"
        body = (await router.post("/v1/chat/completions", {**CHAT, "echo": True})).json()
        assert body["choices"][0]["message"]["content"] == "Paris"

    _run(test)


def test_a_batch_fails_whole_and_aborts_the_prompts_already_admitted():
    async def test(router: Router):
        batch = {**COMPLETION, "prompt": ["Capital?", "Of Peru?", "Of Chad?"]}
        for stream in (False, True):
            router.decode.fail("Reserve", D0, rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no"))
            reply = await router.post("/v1/completions", {**batch, "stream": stream})
            assert reply.status_code == 503
        reply = await router.post("/v1/completions", {**batch, "prompt": ["Capital?", "x" * 60]})
        assert reply.status_code == 400 and "context length 64" in reply.json()["error"]["message"]

    _run(test)  # checks that no reservation is left live


def test_bad_input_gets_an_openai_error_body():
    async def test(router: Router):
        reply = await router.post("/v1/completions", {**COMPLETION, "temperature": "hot"})
        assert reply.status_code == 400
        assert reply.json() == {"error": {"message": "temperature: 'hot' is not a number",
                                          "type": "invalid_request_error",
                                          "param": "temperature", "code": 400}}  # fmt: skip
        reply = await router.post("/v1/completions", {**COMPLETION, "max_tokens": 60})
        assert reply.status_code == 400 and "context length 64" in reply.json()["error"]["message"]
        assert not router.decode.calls

    _run(test)


def test_a_prefill_refusing_to_tokenize_passes_its_status_on():
    async def test(router: Router):
        router.prompts.source = "prefill"
        router.prefill.script(P0, answer(400, {"detail": "bad prompt"}))
        reply = await router.post("/v1/completions", COMPLETION)
        assert reply.status_code == 400 and "bad prompt" in reply.json()["error"]["message"]

    _run(test)


def test_a_failure_before_the_first_token_is_an_http_status_even_when_streaming():
    async def test(router: Router):
        for stream in (False, True):
            router.decode.fail("Reserve", D0, rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no"))
            reply = await router.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert reply.status_code == 503
            assert reply.json()["error"]["type"] == "server_error"

    _run(test)


def test_a_failure_mid_stream_ends_it_with_an_error_event():
    async def test(router: Router):
        router.decode.stream_error = rpc_error(grpc.StatusCode.UNAVAILABLE, "socket closed")
        reply = await router.post("/v1/completions", {**COMPLETION, "stream": True})
        assert reply.status_code == 200
        chunks = _sse(reply)
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Paris"
        assert chunks[-1]["error"]["code"] == 503 and "socket closed" in str(chunks[-1])
        health = (await router.client.get("/health")).json()
        assert health["decode"] == {D0: "down"}

    _run(test)


def test_past_the_queue_limit_a_429_with_retry_after_until_the_slot_is_given_back():
    async def test(router: Router):
        router.decode.stall = True
        first = asyncio.create_task(router.post("/v1/completions", {**COMPLETION, "stream": True}))
        await router.decode.generating.wait()
        refused = await router.post("/v1/chat/completions", CHAT)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == {"message": "1 requests in flight, the limit",
                                           "type": "invalid_request_error", "param": None,
                                           "code": 429}  # fmt: skip
        first.cancel()  # the client goes away
        await asyncio.gather(first, return_exceptions=True)
        assert [a.reason for a in router.decode.aborts()] == ["client gone"]
        router.decode.stall = False
        assert (await router.post("/v1/chat/completions", CHAT)).status_code == 200
        metrics = (await router.client.get("/metrics")).text
        assert "tandem_router_in_flight 0.0" in metrics

    _run(test, max_queue=1)


def test_the_api_key_guards_v1_only():
    async def test(router: Router):
        refused = await router.post("/v1/completions", COMPLETION)
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        assert (await router.client.get("/v1/models")).status_code == 401
        assert (await router.client.get("/health")).status_code == 200
        ok = await router.post("/v1/completions", COMPLETION,
                               headers={"Authorization": "Bearer s3cret"})  # fmt: skip
        assert ok.status_code == 200

    _run(test, api_key="s3cret")


def test_models_health_and_metrics():
    async def test(router: Router):
        card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "tandem",
                "root": MODEL, "parent": None, "max_model_len": 64}  # fmt: skip
        assert (await router.client.get("/v1/models")).json() == {"object": "list", "data": [card]}
        router.decode.max_model_len = 32  # the decode server decodes less than config.json says
        await router.orchestrator.probe()
        assert (await router.client.get("/v1/models")).json()["data"][0]["max_model_len"] == 32
        reply = await router.post("/v1/completions", {**COMPLETION, "max_tokens": 30})
        assert "context length 32" in reply.json()["error"]["message"]
        assert (await router.client.get("/health")).json() == {
            "status": "ok",
            "mode": "disaggregated",
            "tokenizer": {"source": "router", "parity": "unchecked", "segmented": False},
            "decode": {D0: "up"},
            "prefill": {P0: "up"},
        }
        await router.post("/v1/completions", COMPLETION)
        await router.post("/v1/completions", {**COMPLETION, "best_of": 2})
        metrics = (await router.client.get("/metrics")).text
        for line in (
            'tandem_router_requests_total{endpoint="/v1/completions",status="200"} 1.0',
            'tandem_router_requests_total{endpoint="/v1/completions",status="400"} 2.0',
            'tandem_router_errors_total{kind="bad_request"} 2.0',
            "tandem_router_ttft_seconds_count 1.0",
            "tandem_router_e2e_seconds_count 1.0",
            'tandem_router_phase_seconds_count{phase="reserve"} 1.0',
            'tandem_router_phase_seconds_count{phase="prefill"} 1.0',
            'tandem_router_phase_seconds_count{phase="first_message"} 1.0',
            # The prefill's own Server-Timing phases (queue, forward, send), as it timed them.
            'tandem_router_phase_seconds_sum{phase="prefill_forward"} 0.003',
            f'tandem_router_decode_outstanding_tokens{{instance="{D0}"}} 0.0',
            f'tandem_router_prefill_in_flight{{instance="{P0}"}} 0.0',
            "tandem_router_in_flight 0.0",
        ):
            assert line in metrics.splitlines(), line

    _run(test)


def test_chat_logprobs_through_the_api():
    async def test(router: Router):
        body = {**CHAT, "logprobs": True, "top_logprobs": 1}
        choice = (await router.post("/v1/chat/completions", body)).json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
        first = router.prefill.first_token
        assert content[0]["logprob"] == -1 - first / 1024  # the prefill's, for its token
        assert content[0]["top_logprobs"] == [
            {"token": chr(first + 1), "logprob": -0.25, "bytes": list(chr(first + 1).encode())}
        ]
        streamed = _sse(await router.post("/v1/chat/completions", {**body, "stream": True}))
        tokens = [e["token"] for c in streamed if c["choices"][0]["logprobs"]
                  for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
        assert tokens == [entry["token"] for entry in content]

    router = _run(test)
    assert router.prefill.prefilled[0].sampling.logprobs == 1


def test_tokenize_and_detokenize_in_vllms_shapes():
    async def test(router: Router):
        reply = (await router.post("/tokenize", {"model": MODEL, "prompt": "Hi"})).json()
        assert reply == {"count": 2, "max_model_len": 64, "tokens": [72, 105], "token_strs": None}
        chat = await router.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
        assert chat.json()["tokens"] == [ord(c) for c in "user: Hi\nassistant: "]
        assert (await router.post("/detokenize", {"tokens": [72, 105]})).json() == {"prompt": "Hi"}
        for path, body, param in [
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": "Hi"}, "tokens"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
            ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
        ]:
            reply = await router.post(path, body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, body

    _run(test)


class _LeavingClient:
    """The slice of a Starlette request `_unless_client_leaves` reads: the ASGI messages after
    the body, the disconnect `after_s` seconds in (never, if None)."""

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s

    async def receive(self) -> dict:
        if self.after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after_s)
        return {"type": "http.disconnect"}


def test_work_is_cancelled_when_the_client_leaves_first():
    async def test():
        cancelled = asyncio.Event()

        async def endless():
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        async def quick():
            return 42

        assert await _unless_client_leaves(_LeavingClient(None), quick()) == 42
        try:
            await _unless_client_leaves(_LeavingClient(0.01), endless())
        except ClientGone:
            assert cancelled.is_set()
        else:
            raise AssertionError("no ClientGone")

    asyncio.run(test())


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


def test_a_named_tool_choice_constrains_the_output_and_answers_a_tool_call():
    async def test(router: Router):
        arguments = '{"city": "Paris"}'
        router.decode.tokens = [ids(arguments[:5]), ids(arguments[5:])]
        router.decode.finish = decode_pb2.FINISH_REASON_STOP
        named = {"type": "function", "function": {"name": "get_weather"}}
        body = {**CHAT, "max_tokens": 18, "tools": [WEATHER], "tool_choice": named}
        reply = await router.post("/v1/chat/completions", body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": arguments}
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert choice["finish_reason"] == "stop" and not choice["message"]["content"]
        generate = next(r for rpc, _, r in router.decode.calls if rpc == "Generate")
        schema = json.loads(generate.structured_output.json_schema)
        assert schema == WEATHER["function"]["parameters"]
        assert router.prefill.prefilled[-1].structured == generate.structured_output
        assert router.prefill.prefilled[-1].prompt_ids[:7] == ids("tools: ")  # rendered

        chunks = _sse(await router.post("/v1/chat/completions", {**body, "stream": True}))
        streamed = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get(
            "tool_calls", [])]  # fmt: skip
        assert streamed[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"].get("arguments", "") for c in streamed) == arguments

    _run(test)


def test_tool_choice_auto_needs_a_parser():
    async def test(router: Router):
        reply = await router.post("/v1/chat/completions", {**CHAT, "tools": [WEATHER]})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in reply.json()["error"]["message"]

    _run(test)
