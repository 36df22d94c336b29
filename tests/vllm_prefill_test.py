"""Stock vLLM (the CPU build, unpatched) as tandem's prefill engine, through TandemConnector:
real processes, started as a user would. Each request goes the router's way: Reserve on the
decode server -> POST /v1/completions to vLLM with the ticket, max_tokens=1 -> Generate.

The greedy tokens must equal vLLM's own (vLLM without the connector, run first in this file)
for concurrent prompts of different lengths, one prefilled in several chunks and one hitting
vLLM's prefix cache; the decode server must have had exactly the prompt's KV committed, and one
speculating with n-gram lookup must answer the same, and one caching prefixes must be sent
only the KV past the blocks it found; a request without a ticket must be served
as if the connector were absent; a decode server whose KV dtype differs must be refused, the
request failing at once; and `//tools:serve --prefill vllm` must answer as vLLM alone does."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from proto.tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.servers import MODEL, counter, metrics_url, start_decode
from tests.vllm_servers import MAX_BATCHED_TOKENS, complete, generate, prefill, start_vllm, stop
from tools.launch import start

NEW_TOKENS = 12
PERSON = {
    "type": "object",
    "required": ["name", "age"],
    "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers, K and V, KV heads, head_dim, float32
LONG = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
    "steps as his father had taught him: one hundred and twelve, worn smooth in the middle "
    "by a century of boots. At the top he trimmed the wick, polished the great lens until it "
    "threw back the last of the daylight, and wrote the weather in a ledger whose first pages "
    "were in a hand nobody living could read. Ships no longer needed the light. They carried "
    "satellites and radar and charts that updated themselves while the crews slept, and the "
    "harbour authority had written twice to say that the station would be automated in the "
    "spring. He kept climbing anyway. On clear nights he could see the lights of three "
    "villages along the coast, and he liked to imagine that somebody in each of them looked "
    "out at his beam and felt, without quite knowing why, that the sea was a little less "
    "dark. In the winter storms the tower shook, and salt crusted the windows so thickly that "
    "he had to scrape them with a knife before dawn. His daughter wrote from the city asking "
    "when he would come to live with her, and he always answered that he would come when "
    "the light no longer needed him, which both of them understood to mean never. When the "
    "engineers finally arrived with their crates of sensors and solar panels, he made them "
    "tea, showed them where the stairs were loose, and"
)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    encode = tokenizer.encode
    long = encode(LONG)
    assert 256 < len(long) <= 512 - NEW_TOKENS and len(long) > 4 * MAX_BATCHED_TOKENS
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return {
        "short": encode("The capital of France is"),
        "chat": encode(chat, add_special_tokens=False),
        "long": long,  # prefilled in ceil(len / 64) chunks
        # Its first 256 tokens (two of vLLM's 128-token CPU blocks) are cached by "long".
        "prefix_hit": long[:260] + encode(" the sea was calm that night, and"),
    }


@pytest.fixture(scope="module")
def reference(prompts) -> dict[str, list[int]]:
    """vLLM's own greedy tokens (and chat text, under "chat_text"), the connector absent."""
    proc, url = start_vllm(None)
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            outs = {name: _complete(http, prompt) for name, prompt in prompts.items()}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        outs["chat_text"] = _chat(client, MODEL)
        outs["chat_logprobs"] = _chat_logprobs(client, MODEL)
        outs["biased"] = _biased(client, MODEL, prompts["short"], outs["short"])
        outs["scored"] = _scored(client, MODEL, prompts["short"])
        return outs
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def stack():
    """A decode server and vLLM with TandemConnector, both over tcp."""
    decode, address = start_decode("tcp")
    metrics = metrics_url(address)
    vllm, url = start_vllm("tcp")
    channel = grpc.insecure_channel(address)
    http = httpx.Client(base_url=url, timeout=120)
    yield decode_pb2_grpc.DecodeServiceStub(channel), address, metrics, http
    http.close()
    channel.close()
    stop(vllm)
    stop(decode)


def _complete(http: httpx.Client, prompt: list[int]) -> list[int]:
    """A plain greedy completion (no ticket): its tokens; kv_transfer_params stays empty."""
    body = complete(http, prompt, NEW_TOKENS)
    assert body["kv_transfer_params"] is None
    return body["choices"][0]["token_ids"]


def _chat(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0
    )
    return reply.choices[0].message.content


def _chat_logprobs(client: openai.OpenAI, model: str) -> list[tuple]:
    """A greedy chat's logprobs: (token, logprob, the two likeliest tokens) per token."""
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    return [(e.token, e.logprob, [t.token for t in e.top_logprobs])
            for e in reply.choices[0].logprobs.content]  # fmt: skip


def _biased(client: openai.OpenAI, model: str, prompt: list[int], plain: list[int]) -> str:
    """A greedy completion with a logit bias that bans two of its plain tokens (the first, which
    the prefill samples, and one the decode does) and favours another: its text."""
    bias = {str(plain[0]): -100, str(plain[3]): -100, str(plain[5]): 2.5}
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0, logit_bias=bias)  # fmt: skip
    return reply.choices[0].text


def _scored(client: openai.OpenAI, model: str, prompt: list[int]) -> dict:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1) with
    vLLM's prompt_logprobs: the choice's logprobs and prompt_logprobs."""
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      echo=True, logprobs=1,
                                      extra_body={"prompt_logprobs": 2})  # fmt: skip
    choice = reply.choices[0]
    return {"logprobs": choice.logprobs.model_dump(),
            "prompt_logprobs": choice.model_extra["prompt_logprobs"]}  # fmt: skip


def _assert_scored_alike(ours: dict, theirs: dict) -> None:
    """Tokens, ranks and the likeliest tokens equal; log-probabilities to 1e-3."""
    mine, other = ours["logprobs"], theirs["logprobs"]
    assert mine["tokens"] == other["tokens"] and mine["text_offset"] == other["text_offset"]
    assert mine["token_logprobs"][0] is None is other["token_logprobs"][0]
    assert mine["token_logprobs"][1:] == pytest.approx(other["token_logprobs"][1:], abs=1e-3)
    for a, b in zip(mine["top_logprobs"][1:], other["top_logprobs"][1:], strict=True):
        assert a == pytest.approx(b, abs=1e-3)
    assert ours["prompt_logprobs"][0] is None is theirs["prompt_logprobs"][0]
    for a, b in zip(ours["prompt_logprobs"][1:], theirs["prompt_logprobs"][1:], strict=True):
        assert [(k, v["rank"], v["decoded_token"]) for k, v in a.items()] == [
            (k, v["rank"], v["decoded_token"]) for k, v in b.items()]  # fmt: skip
        assert [v["logprob"] for v in a.values()] == pytest.approx(
            [v["logprob"] for v in b.values()], abs=1e-3)  # fmt: skip


def _prefill(stub, http, address: str, request_id: str, prompt: list[int]):
    return prefill(stub, http, address, request_id, prompt, NEW_TOKENS)


def _settled(read, want: float) -> float:
    """`read()` once it reaches `want`, or after 10 s: servers count a request in their
    Prometheus metrics just after they have answered it."""
    deadline = time.monotonic() + 10
    while (value := read()) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _generate(stub, ticket, first_token: int) -> list[int]:
    return generate(stub, ticket, first_token, NEW_TOKENS)


def _disaggregated(stub, http, address: str, request_id: str, prompt: list[int]) -> list[int]:
    ticket, kv = _prefill(stub, http, address, request_id, prompt)
    assert kv == {"first_token_id": kv["first_token_id"], "kv_tokens": len(prompt)}
    return _generate(stub, ticket, kv["first_token_id"])


def test_vllm_prefill_and_tandem_decode_equal_vllm_alone(stack, prompts, reference):
    stub, address, metrics, http = stack
    vllm_metrics = str(http.base_url.join("/metrics"))
    committed_before = counter(metrics, "tandem_decode_transfer_bytes_total")
    concurrent = ["short", "chat", "long"]
    with ThreadPoolExecutor(len(concurrent)) as pool:
        outs = dict(zip(concurrent, pool.map(
            lambda name: _disaggregated(stub, http, address, name, prompts[name]), concurrent),
            strict=True))  # fmt: skip
    hits_before = counter(vllm_metrics, "vllm:prefix_cache_hits_total")
    outs["prefix_hit"] = _disaggregated(stub, http, address, "prefix_hit", prompts["prefix_hit"])
    hits = _settled(
        lambda: counter(vllm_metrics, "vllm:prefix_cache_hits_total") - hits_before, 256
    )
    assert hits >= 256  # two 128-token blocks of "long"
    assert outs == {name: reference[name] for name in prompts}
    # The KV moved: the decode server accepted commits of exactly each prompt's KV bytes.
    sent = sum(len(prompts[name]) for name in outs)
    committed = _settled(
        lambda: counter(metrics, "tandem_decode_transfer_bytes_total") - committed_before,
        sent * KV_BYTES_PER_TOKEN,
    )
    assert committed == sent * KV_BYTES_PER_TOKEN
    stats = stub.Stats(decode_pb2.StatsRequest())
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.reserved == 0


def test_an_ngram_decode_behind_vllm_equals_vllm_alone(stack, prompts, reference):
    """n-gram speculation needs no prompt KV of its own: a decode server speculating with it
    takes vLLM's tickets as they are, and its greedy tokens stay vLLM's."""
    _, _, _, http = stack
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    decode, address = start_decode("tcp", "float32", "--speculative-config", spec)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            outs = {name: _disaggregated(stub, http, address, f"ngram-{name}", prompts[name])
                    for name in ("short", "long")}  # fmt: skip
        assert outs == {name: reference[name] for name in outs}
        assert counter(metrics_url(address), "tandem_decode_spec_draft_tokens_total") > 0
    finally:
        stop(decode)


def test_vllm_writes_only_what_a_caching_decode_server_has_not_found(stack, prompts, reference):
    """A decode server caching prefixes reserves "prefix_hit" with the blocks "long" left it:
    vLLM's connector sends the tokens after them only, and the greedy tokens stay vLLM's."""
    _, _, _, http = stack
    decode, address = start_decode("tcp", "float32", "--enable-prefix-caching")
    metrics = metrics_url(address)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            outs, committed = {}, []
            for name in ("long", "prefix_hit"):
                before = counter(metrics, "tandem_decode_transfer_bytes_total")
                outs[name] = _disaggregated(stub, http, address, f"cached-{name}", prompts[name])
                committed.append(counter(metrics, "tandem_decode_transfer_bytes_total") - before)
        assert outs == {name: reference[name] for name in outs}
        # The 16 blocks of 16 tokens "prefix_hit" shares with "long" were not sent again.
        assert counter(metrics, "tandem_decode_prefix_cache_hits_total") == 256
        assert committed == [len(prompts["long"]) * KV_BYTES_PER_TOKEN,
                             (len(prompts["prefix_hit"]) - 256) * KV_BYTES_PER_TOKEN]  # fmt: skip
    finally:
        stop(decode)


def test_a_request_without_a_ticket_is_untouched(stack, prompts, reference):
    _, _, metrics, http = stack
    committed_before = counter(metrics, "tandem_decode_transfer_bytes_total")
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda name: _complete(http, prompts[name]), ["short", "long"]))
    assert outs == [reference["short"], reference["long"]]
    assert counter(metrics, "tandem_decode_transfer_bytes_total") == committed_before


def test_a_decode_server_with_another_kv_dtype_fails_the_request_at_once(stack, prompts):
    """vLLM's worker side says Hello to a bfloat16 decode server, is refused, writes nothing
    and commits the refusal, so the ticket fails now rather than at its deadline.

    The refusal's message, naming both dtypes, is the commit's error; a Generate arriving after
    that commit gets it back (ABORTED)."""
    _, _, _, http = stack
    decode, address = start_decode("tcp", dtype="bfloat16")
    metrics = metrics_url(address)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            ticket, kv = _prefill(stub, http, address, "bf16", prompts["short"])
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                _generate(stub, ticket, kv["first_token_id"])
            assert time.monotonic() - started < 5  # the ticket's deadline is 30 s away
            assert error.value.code() == grpc.StatusCode.ABORTED
            assert "bfloat16" in error.value.details(), error.value.details()
            stats = stub.Stats(decode_pb2.StatsRequest())
            # Freed at once: the sender committed, so no write can still land (no quarantine).
            assert stats.kv_blocks_free == stats.kv_blocks_total
            assert counter(metrics, "tandem_decode_transfer_bytes_total") == 0
    finally:
        stop(decode)


def test_the_router_cannot_tell_vllm_from_tandems_prefill(prompts, reference):
    """`//tools:serve --prefill vllm`, as a user runs it: tandem's router in front of vLLM as it
    is in front of tandem's prefill server: its tokenizer check against /tokenize, then chat
    through Reserve, prefill and Generate; with logprobs, the first token's from vLLM and the
    rest from the decode server, equal to vLLM's own; a logit bias's greedy text equal to vLLM's
    own (vLLM biases the first token, the decode server the rest); an echo scoring the prompt
    and vLLM's prompt_logprobs equal to vLLM's own (vLLM computes them); a JSON Schema that both
    constrain (likewise); and n=2 with a seed: two choices from one KV transfer (vLLM's two
    child requests send it once)."""
    proc, m = start(["tools.serve", "--prefill", "vllm", "--model", MODEL, "--port", "0",
                     "--kv-cache-gb", "1"],
                    r"tandem ready: (http://\S+) \(decode metrics: (\S+)\)",
                    timeout=600)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{m.group(1)}/v1", api_key="unused", max_retries=0)
        served = client.models.list().data[0].id
        assert _chat(client, served) == reference["chat_text"]
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        reply = client.chat.completions.create(
            model=served, messages=MESSAGES, max_tokens=48, temperature=0, response_format=schema
        )
        person = json.loads(reply.choices[0].message.content)
        assert set(person) == {"name", "age"} and type(person["age"]) is int
        logprobs = _chat_logprobs(client, served)
        expected = reference["chat_logprobs"]
        assert [(t, top) for t, _, top in logprobs] == [(t, top) for t, _, top in expected]
        assert [lp for _, lp, _ in logprobs] == pytest.approx([lp for _, lp, _ in expected],
                                                              abs=1e-3)  # fmt: skip
        assert _biased(client, served, prompts["short"], reference["short"]) == reference["biased"]
        _assert_scored_alike(_scored(client, served, prompts["short"]), reference["scored"])
        _assert_n_choices_share_one_transfer(client, served, m.group(2))
    finally:
        stop(proc)


def _assert_n_choices_share_one_transfer(client: openai.OpenAI, model: str, metrics: str) -> None:
    # NOTE: a short prompt: vLLM's CPU build fails its engine on a seeded request prefilled in
    # chunks ("CPU Generator does not use offset", 0.32).
    kwargs = {"model": model, "prompt": LONG[:60], "max_tokens": 8, "temperature": 1.0,
              "seed": 3, "extra_body": {"ignore_eos": True}}  # fmt: skip
    before = counter(metrics, "tandem_decode_transfer_bytes_total")
    one = client.completions.create(**kwargs)
    once = _settled(lambda: counter(metrics, "tandem_decode_transfer_bytes_total") - before, 1)
    two = client.completions.create(**kwargs, n=2)
    total = _settled(lambda: counter(metrics, "tandem_decode_transfer_bytes_total") - before,
                     2 * once)  # fmt: skip
    assert total == 2 * once == 2 * one.usage.prompt_tokens * KV_BYTES_PER_TOKEN
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text  # seeds 3 and 4
    assert two.usage.completion_tokens == 16
