"""tandem's prefill server in this process (its FastAPI app, a random tiny model on the CPU):
what it answers when its engine fails, that a request given up on does not fail it, its
completions' logprobs in vLLM's shape, `n` choices (seeded as vLLM seeds them, the prompt's KV
sent once to a stand-in decode server), and vLLM's `structured_outputs` (with SmolLM2's
tokenizer cut to the tiny model's 256 tokens, its specials and single characters, where a
grammar is compiled)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

import transport
from engine.grammar import GrammarCompiler
from engine.llm_engine import EngineConfig, LLMEngine
from engine.openai_logprobs import completion_logprobs
from engine.sampling import SamplingParams, TokenLogprobs
from engine.sequence import StopConditions
from prefill import server_timing
from prefill.server import PrefillServer, PrefillServerConfig
from prefill.tests.fake_decode import FakeDecode
from prefill.ticket import DECODE_LAYOUT, layout_descriptor, transfer_params
from prefill.worker import Job
from proto.tandem.v1 import decode_pb2, decode_pb2_grpc, layout_pb2

TOKENIZER = Path("tools/smollm2-135m-instruct")  # Bazel data: //tools:smollm2


@pytest.fixture()
def server():
    server = PrefillServer(
        PrefillServerConfig(EngineConfig(model="random:tiny", dtype="float32", kv_cache_gb=0.01))
    )
    yield server
    server.stop()


def _bounded(call, timeout_s: float = 30):
    """The call's result, or a TimeoutError where it would hang."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call).result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False)  # a hung call must not hold the test up as well


def test_an_engine_failure_fails_requests_with_503_and_health_says_so(server):
    """A step that raises (a CUDA error, say) loses the engine's state: the request in it gets a
    503 naming the error instead of waiting forever, later ones too, and /health goes 503 so the
    router marks the instance down until it is restarted."""
    client = TestClient(server.app)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0}
    ok = _bounded(lambda: client.post("/v1/completions", json=body))
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3

    def failing_step(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    server.engine.step = failing_step
    for _ in range(2):  # the request in the failing step, then one arriving after it
        reply = _bounded(lambda: client.post("/v1/completions", json=body))
        assert reply.status_code == 503
        error = reply.json()["error"]
        assert error["type"] == "server_error"
        assert "RuntimeError: CUDA error: an illegal memory access" in error["message"]
        assert "restart the prefill server" in error["message"]
    health = _bounded(lambda: client.get("/health"))
    assert health.status_code == 503 and "RuntimeError" in health.json()["error"]["message"]


def test_a_request_given_up_on_leaves_the_engine_serving(server):
    """A caller that gave up on its request (its future cancelled) before the engine refused it
    must not take the engine down with it."""
    gone = Job([1] * 100_000, SamplingParams(), StopConditions(max_tokens=1), None)  # too long
    gone.future.cancel()
    server.worker.submit([gone])
    client = TestClient(server.app)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0}
    reply = _bounded(lambda: client.post("/v1/completions", json=body))
    assert reply.status_code == 200, reply.text
    assert server.worker.failure is None


def test_a_request_whose_admission_fails_the_engine_gets_503(server):
    """The engine raising while it takes a request in (not a refusal: a bug, a CUDA error) fails
    that request too, although it is neither queued nor running by then."""
    client = TestClient(server.app)

    def failing_add(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    server.engine.add_request = failing_add
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0}
    reply = _bounded(lambda: client.post("/v1/completions", json=body), timeout_s=15)
    assert reply.status_code == 503
    assert "RuntimeError: CUDA error: out of memory" in reply.json()["error"]["message"]
    assert server.worker.failure is not None


@pytest.fixture()
def decode(server):
    """A stand-in decode server for `server`'s model: a cache [layer, K|V, block, head, token,
    dim] (blocks of 4 tokens) behind a TCP agent, and the stand-in gRPC service."""
    model = server.engine.model_config
    layout = layout_descriptor(
        model_name="tiny", num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, kv_dtype="float32", block_size=4, layout=DECODE_LAYOUT,
        transport="tcp",
    )  # fmt: skip
    agent = transport.create("tcp")
    cache = torch.zeros(model.num_layers, 2, 4, model.num_kv_heads, 4, model.head_dim)
    agent.register(cache.data_ptr(), cache.numel() * 4)
    service = FakeDecode(layout)
    grpc_server = grpc.server(ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(service, grpc_server)
    address = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
    grpc_server.start()
    yield service, lambda num_tokens: _ticket(agent, cache, layout, address, num_tokens)
    grpc_server.stop(None)
    agent.close()


def _ticket(agent, cache, layout, address: str, num_tokens: int) -> dict:
    """kv_transfer_params with a ticket for `num_tokens` tokens into the decode cache."""
    regions = [
        layout_pb2.LayerRegions(
            k=layout_pb2.KvRegion(addr=layer[0].data_ptr(), nbytes=layer[0].numel() * 4),
            v=layout_pb2.KvRegion(addr=layer[1].data_ptr(), nbytes=layer[1].numel() * 4),
        )
        for layer in cache
    ]
    heads = layout_pb2.HeadRange(start=0, end=cache.shape[3])
    endpoint = layout_pb2.TransportEndpoint(transport="tcp", metadata=agent.endpoint())
    ticket = decode_pb2.Ticket(
        request_id="t", generation=1, num_tokens=num_tokens, block_ids=[2, 0, 3],
        block_stride_bytes=cache.stride(2) * 4, head_stride_bytes=cache.stride(3) * 4,
        shards=[decode_pb2.KvShard(rank=0, heads=heads, endpoint=endpoint, layers=regions)],
        layout=layout, num_senders=1, deadline_unix_ms=int((time.time() + 30) * 1000),
    )  # fmt: skip
    return transfer_params(ticket, address)


def test_n_choices_send_the_prompts_kv_once(server, decode):
    service, ticket = decode
    prompt = list(range(1, 11))
    body = {"prompt": prompt, "max_tokens": 1, "n": 3, "temperature": 1.0,
            "return_token_ids": True, "kv_transfer_params": ticket(len(prompt))}  # fmt: skip
    reply = _bounded(lambda: TestClient(server.app).post("/v1/completions", json=body))
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 1 for c in choices)
    model = server.engine.model_config
    prompt_bytes = 2 * model.num_layers * len(prompt) * model.num_kv_heads * model.head_dim * 4
    (commit,) = service.commits
    assert commit.bytes_written == prompt_bytes and not commit.error
    params = reply.json()["kv_transfer_params"]
    assert params["bytes_written"] == prompt_bytes
    assert params["first_token_id"] == choices[0]["token_ids"][0]


def test_n_choices_sample_with_seed_plus_index(server):
    client = TestClient(server.app)

    def complete(**fields) -> dict:
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 1.0, "logprobs": 1,
                "return_tokens_as_token_ids": True, **fields}  # fmt: skip
        reply = _bounded(lambda: client.post("/v1/completions", json=body))
        assert reply.status_code == 200, reply.text
        return reply.json()

    two = complete(n=2, seed=7)
    choices = two["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        names = [f"token_id:{t}" for t in choice["token_ids"]]
        assert len(names) == 3 and choice["logprobs"]["tokens"] == names
    assert two["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    tokens = [c["token_ids"] for c in choices]
    assert [c["token_ids"] for c in complete(n=2, seed=7)["choices"]] == tokens
    assert complete(seed=7)["choices"][0]["token_ids"] == tokens[0]
    assert complete(seed=8)["choices"][0]["token_ids"] == tokens[1]


@pytest.mark.parametrize("n", [0, "2", True, None, 16385])
def test_a_bad_n_gets_400_naming_it(server, n):
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "n": n}
    reply = _bounded(lambda: TestClient(server.app).post("/v1/completions", json=body))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "n"
    assert error["message"] == f"n: {n!r} is not an integer in [1, 16384]"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 100000, "body: not valid JSON"),  # too deep for Python's parser
        (b"[1]", "body: must be a JSON object"),
        (b'{"prompt": [1], "max_tokens": 1, "stop": ["\\ud800"]}',
         "body: a string holds an unpaired UTF-16 surrogate (not Unicode)"),
    ],
)  # fmt: skip
def test_a_body_that_is_no_json_object_of_text_gets_400(server, raw, message):
    reply = _bounded(lambda: TestClient(server.app).post("/v1/completions", content=raw))
    assert reply.status_code == 400 and reply.json()["error"]["message"] == message


def test_completion_logprobs_take_vllms_shape(server):
    client = TestClient(server.app)
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "temperature": 0, "logprobs": 2,
            "return_tokens_as_token_ids": True}  # fmt: skip
    reply = _bounded(lambda: client.post("/v1/completions", json=body))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    names = [f"token_id:{t}" for t in choice["token_ids"]]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == names
    assert logprobs["text_offset"] == [0, len(names[0]), len(names[0]) + len(names[1])]
    rows = zip(names, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    for name, logprob, top in rows:
        # Greedy: the token is the most likely one, so 2 entries, not 3; most likely first.
        assert next(iter(top)) == name and top[name] == logprob < 0
        assert len(top) == 2 and list(top.values()) == sorted(top.values(), reverse=True)
    del body["logprobs"]
    reply = _bounded(lambda: client.post("/v1/completions", json=body))
    assert reply.json()["choices"][0]["logprobs"] is None


def test_prompt_logprobs_take_vllms_shape_in_every_choice(server):
    """The prompt's first token has none; each other one {id: {logprob, rank, decoded_token}}
    of itself, then of the most likely tokens there; they are those the engine computed."""
    client = TestClient(server.app)
    prompt = [1, 2, 3, 4, 5]
    body = {"prompt": prompt, "max_tokens": 1, "n": 2, "temperature": 1.0, "seed": 5,
            "prompt_logprobs": 2}  # fmt: skip
    reply = _bounded(lambda: client.post("/v1/completions", json=body))
    assert reply.status_code == 200, reply.text
    first, second = (c["prompt_logprobs"] for c in reply.json()["choices"])
    assert first == second and first[0] is None and len(first) == len(prompt)
    alone = LLMEngine.build(server.config.engine)  # the same random weights (seeded)
    alone.add_request("alone", prompt, SamplingParams(prompt_logprobs=2), StopConditions(1))
    [out] = alone.step()
    entries = out.prompt_logprobs
    for token, entry, expected in zip(prompt[1:], first[1:], entries, strict=True):
        own = entry[str(token)]
        assert own == {"logprob": pytest.approx(expected.logprob, abs=1e-5),
                       "rank": expected.rank, "decoded_token": f"token_id:{token}"}  # fmt: skip
        tops = [(int(k), v["rank"]) for k, v in entry.items() if k != str(token)]
        ranked = [(t, r) for r, t in enumerate(expected.top_token_ids, 1) if t != token]
        assert tops == ranked
    del body["prompt_logprobs"]
    reply = _bounded(lambda: client.post("/v1/completions", json=body))
    assert [c["prompt_logprobs"] for c in reply.json()["choices"]] == [None, None]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", 21, "logprobs: 21 is not in [0, 20]"),
        ("prompt_logprobs", -1, "prompt_logprobs: -1 is not in [0, 20]"),
        ("return_tokens_as_token_ids", "yes", "return_tokens_as_token_ids: 'yes' is not a boolean"),
    ],
)
def test_bad_logprobs_fields_get_400(server, field, value, message):
    client = TestClient(server.app)
    body = {"prompt": [1, 2, 3], "max_tokens": 1, field: value}
    reply = _bounded(lambda: client.post("/v1/completions", json=body))
    assert reply.status_code == 400 and reply.json()["error"]["message"] == message


def test_completion_logprobs_put_the_token_first_then_the_most_likely():
    """A sampled token outside the top N makes N + 1 entries; -inf is clamped as vLLM does."""
    logprobs = [
        TokenLogprobs(-3.0, (7, 8), (-0.5, -1.0)),
        TokenLogprobs(float("-inf"), (9,), (-0.1,)),
    ]
    out = completion_logprobs([5, 6], logprobs, lambda t: "ab" if t == 5 else f"<{t}>")
    assert out == {
        "tokens": ["ab", "<6>"],
        "token_logprobs": [-3.0, -9999.0],
        "top_logprobs": [{"ab": -3.0, "<7>": -0.5, "<8>": -1.0}, {"<6>": -9999.0, "<9>": -0.1}],
        "text_offset": [0, 2],
    }
    # An echoed prompt (its first token has none) whose entries list more than asked: the
    # first top_n + 1 kept, as vLLM keeps them (the token itself one of them).
    prompt = [None, TokenLogprobs(-0.5, (7, 8), (-0.5, -1.0))]
    out = completion_logprobs([5, 7], prompt, lambda t: f"<{t}>", top_n=1)
    assert out["token_logprobs"] == [None, -0.5]
    assert out["top_logprobs"] == [None, {"<7>": -0.5, "<8>": -1.0}]


def test_structured_outputs_constrain_the_tokens_or_get_400(server):
    client = TestClient(server.app)

    def complete(structured_outputs: dict, **fields):
        body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, **fields,
                "structured_outputs": structured_outputs}  # fmt: skip
        return _bounded(lambda: client.post("/v1/completions", json=body))

    reply = complete({"regex": "[0-9]+"})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "structured_outputs: needs the model's tokenizer, and random:tiny has none"
    )
    vocab = server.engine.model_config.vocab_size
    server.engine.grammars = GrammarCompiler(str(TOKENIZER), vocab)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    choices = ["12", "345"]
    for fields in ({}, {"temperature": 1.0, "seed": 3}):
        reply = complete({"choice": choices}, **fields)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert tokenizer.decode(choice["token_ids"][:-1]) in choices
    reply = complete({"json": json.dumps({"type": "objekt"})})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        'structured_outputs: json_schema: does not compile: Unsupported type "objekt"'
    )


def test_tokenize_renders_with_vllms_template_arguments(server):
    """/tokenize takes what vLLM's does: a conversation whose last message continues."""
    server.tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    reply = TestClient(server.app).post("/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    assert server.tokenizer.decode(reply.json()["tokens"]).endswith("assistant\nIt is")
    bad = TestClient(server.app).post("/tokenize", json={**body, "add_generation_prompt": True})
    assert bad.status_code == 400 and "chat template" in bad.json()["error"]["message"]


def _phases(reply) -> dict[str, float]:
    return server_timing.parse(reply.headers["server-timing"])


def test_a_reply_times_its_phases_in_server_timing(server, decode):
    service, ticket = decode
    service.commit_delay_s = 0.3
    client, prompt = TestClient(server.app), list(range(1, 11))
    alone = _bounded(lambda: client.post("/v1/completions", json={"prompt": prompt}))
    assert set(_phases(alone)) == {"queue", "forward"}, alone.headers
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": ticket(len(prompt))}
    started = time.monotonic()
    sent = _bounded(lambda: client.post("/v1/completions", json=body))
    elapsed_ms = (time.monotonic() - started) * 1000
    phases = _phases(sent)
    assert set(phases) == {"queue", "forward", "send"}, sent.headers
    assert all(ms >= 0 for ms in phases.values()), phases
    assert 300 <= phases["send"] <= elapsed_ms  # the commit's wait is the send's tail
    assert phases["forward"] < 300 and sum(phases.values()) <= elapsed_ms
