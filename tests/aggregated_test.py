"""Aggregated serving and the decode-only fallback, with real processes (the bundled SmolLM2 on
the CPU, over tcp): a router started with --aggregated in front of the decode server alone
answers with the same greedy text as the disaggregated stack; with prefix caching on both
servers, a prompt sent again reuses its cached blocks (counted in the decode server's
tandem_decode_prefix_cache_hits_total), text unchanged, and a disaggregated prompt's prefill
sends only the KV of the blocks the decode server did not find, and a prompt asking for its
log-probabilities is computed whole, as the prefill server computes them; with two decode servers, a
conversation's next turn goes to the one holding its start; with the only prefill stopped, the
disaggregated router serves every request through the decode server (each counted in
tandem_router_decode_only_fallback_total), text unchanged; the prefill started again at its
address takes the requests back. Afterwards no KV block stays allocated on the decode server.
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.servers import (
    MODEL,
    counter,
    decode_pool_free,
    metrics_url,
    start_decode,
    start_prefill,
    start_router,
    stop,
    stream_long,
)

PROMPTS = ["Count to ten:", "The capital of France is", "def fibonacci(n):"]
LOCAL = "tandem_decode_local_prefills_total"
FALLBACK = "tandem_router_decode_only_fallback_total"
HITS = "tandem_decode_prefix_cache_hits_total"
SENT = "tandem_decode_transfer_bytes_total"


@pytest.fixture(scope="module")
def stack():
    """The decode server, its prefill, a disaggregated and an aggregated router in front."""
    decode, address = start_decode("tcp", "float32", "--enable-prefix-caching")
    prefill, prefill_url = start_prefill("tcp", 0, "--enable-prefix-caching")
    router, url = start_router([prefill_url], [address])
    aggregated, aggregated_url = start_router([], [address], "--aggregated")
    procs = {"prefill": prefill}
    yield address, prefill_url, url, aggregated_url, procs
    stop(aggregated, router, procs["prefill"], decode)


def _texts(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0
        texts.append(reply.json()["choices"][0]["text"])
    return texts


def _mode(url: str) -> str:
    return httpx.get(f"{url}/health", timeout=10).json()["mode"]


def test_aggregated_answers_as_the_disaggregated_stack(stack):
    address, _, url, aggregated_url, _ = stack
    decode_metrics = metrics_url(address)
    disaggregated = _texts(url)
    before = counter(decode_metrics, LOCAL)
    assert _texts(aggregated_url) == disaggregated
    assert counter(decode_metrics, LOCAL) - before == len(PROMPTS)
    assert _mode(aggregated_url) == "aggregated"
    assert counter(f"{aggregated_url}/metrics", FALLBACK) == 0
    assert decode_pool_free(address)


def test_a_prompt_prefilled_again_reuses_the_cached_blocks_of_the_first(stack):
    # The decode server caches prefixes: its full blocks of a prompt it prefilled (or was sent)
    # serve the same prompt's next request; the text is unchanged.
    address, prefill_url, url, aggregated_url, _ = stack
    decode_metrics = metrics_url(address)
    prompt = "Repeat after me: " + ", ".join(str(i) for i in range(40))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    texts, hits = [], []
    # The prefill caches prefixes too: the last request's KV is its cached blocks', sent.
    for target in (aggregated_url, aggregated_url, url, url):
        before = counter(decode_metrics, "tandem_decode_prefix_cache_hits_total")
        reply = httpx.post(f"{target}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
        hits.append(counter(decode_metrics, "tandem_decode_prefix_cache_hits_total") - before)
    assert texts[0] == texts[1] == texts[2] == texts[3]
    prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    # From the second on: every full block but the one holding the prompt's last token (the
    # disaggregated ones' found when their blocks were reserved).
    assert hits == [0] + [(prompt_tokens - 1) // 16 * 16] * 3
    # The prefill's reply names what its cache held, as OpenAI's usage does.
    reply = httpx.post(f"{prefill_url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert reply.status_code == 200, reply.text
    cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16
    assert decode_pool_free(address)


def test_the_prompts_log_probabilities_are_the_disaggregated_stacks(stack):
    """Computed by the decode server's own prefill (every choice's echo starts with them, and
    the cache, warm with the prompt, is passed over), as the prefill server computes them."""
    address, _, url, aggregated_url, _ = stack
    prompt = "Repeat after me: " + ", ".join(str(i) for i in range(40))  # cached above
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 2, "echo": True,
            "prompt_logprobs": 2, "n": 2, "temperature": 1.0, "seed": 4}  # fmt: skip
    replies = []
    for target in (url, aggregated_url):
        reply = httpx.post(f"{target}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        replies.append(reply.json()["choices"])
    size = len(replies[0][0]["prompt_logprobs"])
    for ours, theirs in zip(*replies, strict=True):
        mine, other = ours["logprobs"], theirs["logprobs"]
        assert mine["tokens"][:size] == other["tokens"][:size]
        assert mine["token_logprobs"][0] is None is other["token_logprobs"][0]
        assert mine["token_logprobs"][1:size] == pytest.approx(other["token_logprobs"][1:size],
                                                               abs=1e-4)  # fmt: skip
        for position in range(1, size):
            assert mine["top_logprobs"][position] == pytest.approx(
                other["top_logprobs"][position], abs=1e-4)  # fmt: skip
            entry, expected = ours["prompt_logprobs"][position], theirs["prompt_logprobs"][position]
            assert [(k, v["rank"]) for k, v in entry.items()] == [
                (k, v["rank"]) for k, v in expected.items()]  # fmt: skip
    assert decode_pool_free(address)


def test_a_disaggregated_prompt_is_sent_only_past_the_decode_servers_cached_blocks(stack):
    # The decode server's Reserve finds the blocks it holds of a prompt's start (here: those a
    # first request's prompt left), its ticket says so, and the prefill writes only the rest;
    # the text is the prefill engine's own.
    address, prefill_url, url, _, _ = stack
    decode_metrics = metrics_url(address)
    first = [(7919 * i) % 40000 + 100 for i in range(41)]  # no earlier prompt starts so
    second = first + [(104729 * i) % 40000 + 100 for i in range(30)]
    hits, sent = [], []
    for prompt in (first, second):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        before = [counter(decode_metrics, name) for name in (HITS, SENT)]
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        alone = httpx.post(f"{prefill_url}/v1/completions", json=body, timeout=60)
        assert reply.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        hits.append(counter(decode_metrics, HITS) - before[0])
        sent.append(counter(decode_metrics, SENT) - before[1])
    # The first prompt's two full blocks; its third holds its last token and the first output.
    assert hits == [0, 32]
    per_token = sent[0] / len(first)
    assert sent[1] == per_token * (len(second) - 32)
    assert decode_pool_free(address)


def _ids_text(url: str, prompt: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_conversations_next_turn_goes_to_the_decode_server_holding_its_start(stack):
    # Two decode servers caching prefixes, equally idle: the router sends a turn where the
    # turn before it went (to the first listed, `other`, were its load all it weighed).
    address, prefill_url, _, _, _ = stack
    other, other_address = start_decode("tcp", "float32", "--enable-prefix-caching")
    router, url = start_router([prefill_url], [other_address, address])
    try:
        stats = decode_pool_free(other_address)
        assert stats.prefix_caching and stats.layout.block_size == 16
        turn = [(7907 * i) % 40000 + 100 for i in range(41)]
        before = counter(metrics_url(address), HITS)
        # While a long request keeps `other` busy, the first turn goes to `address`.
        _, error, _ = stream_long(url, 40, lambda: _ids_text(url, turn))
        assert error is None
        _ids_text(url, turn + [(104723 * i) % 40000 + 100 for i in range(10)])
        assert counter(metrics_url(address), HITS) - before == 32
        assert decode_pool_free(other_address)
    finally:
        stop(router, other)


def test_with_the_prefill_stopped_the_decode_server_serves_until_it_is_back(stack):
    address, prefill_url, url, _, procs = stack
    decode_metrics = metrics_url(address)
    disaggregated = _texts(url)
    assert _mode(url) == "disaggregated"
    stop(procs["prefill"])
    local = counter(decode_metrics, LOCAL)
    assert _texts(url) == disaggregated
    assert counter(f"{url}/metrics", FALLBACK) == len(PROMPTS)
    assert counter(decode_metrics, LOCAL) - local == len(PROMPTS)
    assert _mode(url) == "decode-only fallback"
    procs["prefill"], _ = start_prefill("tcp", urlparse(prefill_url).port)
    deadline = time.monotonic() + 15
    while httpx.get(f"{url}/health", timeout=10).json()["prefill"][prefill_url] != "up":
        assert time.monotonic() < deadline, "the prefill was never probed back up"
        time.sleep(0.2)
    local = counter(decode_metrics, LOCAL)
    assert _texts(url) == disaggregated
    assert counter(decode_metrics, LOCAL) == local  # prefilled by the prefill again
    assert counter(f"{url}/metrics", FALLBACK) == len(PROMPTS)
    assert _mode(url) == "disaggregated"
    assert decode_pool_free(address)
