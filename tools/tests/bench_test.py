"""Tests of //tools:bench (tools/bench/): the percentile and CDF math, reproducible datasets,
the runner against a fake OpenAI server (history, error counting), and the CLI against the real
tandem stack started by //tools:serve."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tools.bench.client import RequestResult
from tools.bench.datasets import (
    Endpoint,
    TokenizerText,
    WordText,
    agentic_dataset,
    random_dataset,
)
from tools.bench.report import cdf, percentiles, summarize
from tools.bench.runner import Load, RunResult
from tools.launch import start
from tools.tests.fake_openai import FakeServer

MODEL = "tools/smollm2-135m-instruct"  # Bazel data: //tools:smollm2


def test_percentiles_interpolate_linearly_between_ranks():
    stats = percentiles([float(v) for v in range(100, 0, -1)])
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_cdf_steps_through_the_sorted_values():
    assert cdf([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])
    assert cdf([]) == ([], [])


def test_summary_counts_errors_by_kind_and_tokens_of_successes_only():
    def ok(tokens: int, ttft: float, e2e: float) -> RequestResult:
        return RequestResult(0, 0, 0.0, ttft=ttft, e2e=e2e, itl=[0.01] * (tokens - 1),
                             prompt_tokens=10, output_tokens=tokens)  # fmt: skip

    results = [
        ok(5, 0.1, 0.5),
        ok(3, 0.2, 0.4),
        RequestResult(1, 0, 0.0, error="http_500", detail="boom"),
        RequestResult(2, 0, 0.0, error="http_500"),
        RequestResult(3, 0, 0.0, error="timeout"),
    ]
    summary = summarize(RunResult(results, duration=2.0), planned=7)
    assert (summary["completed"], summary["failed"], summary["not_sent"]) == (2, 3, 2)
    assert summary["errors"] == {"http_500": 2, "timeout": 1}
    assert summary["error_examples"] == {"http_500": "boom", "timeout": ""}
    assert (summary["input_tokens"], summary["output_tokens"]) == (20, 8)
    assert summary["output_throughput"] == pytest.approx(4.0)
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.4 s / 4 + 0.2 s / 2) / 2
    assert summary["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(10.0)


def test_random_dataset_is_reproducible_by_seed():
    first = random_dataset(WordText(), 5, input_len=40, output_len=7, seed=3)
    assert first == random_dataset(WordText(), 5, input_len=40, output_len=7, seed=3)
    assert first != random_dataset(WordText(), 5, input_len=40, output_len=7, seed=4)
    assert len({c.turns[0].text for c in first}) == 5
    for conversation in first:
        assert conversation.endpoint is Endpoint.COMPLETIONS
        (turn,) = conversation.turns
        assert len(turn.text.split()) == 40 and turn.output_len == 7


def test_tokenizer_prompts_have_exact_token_counts():
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    source = TokenizerText(tokenizer)
    for length in (1, 32, 500):
        for conversation in random_dataset(source, 8, length, 4, seed=length):
            ids = tokenizer.encode(conversation.turns[0].text, add_special_tokens=False)
            assert len(ids) == length


def test_agentic_dataset_is_reproducible_and_its_turns_vary_around_the_mean():
    def make(seed: int):
        return agentic_dataset(WordText(), 4, num_turns=6, system_len=300, turn_len=80,
                               output_len=9, seed=seed)  # fmt: skip

    first = make(seed=1)
    assert first == make(seed=1) and first != make(seed=2)
    assert len({c.system for c in first}) == 1 and WordText().count(first[0].system) >= 300
    for conversation in first:
        assert conversation.endpoint is Endpoint.CHAT and len(conversation.turns) == 6
        lengths = [WordText().count(t.text) for t in conversation.turns]
        assert all(40 <= n <= 160 for n in lengths), lengths
        assert all(t.output_len == 9 for t in conversation.turns)


def test_random_requests_stream_with_usage_and_ask_for_the_output_length():
    conversations = random_dataset(WordText(), 5, input_len=12, output_len=4, seed=0)
    server = FakeServer()
    result = server.run(conversations, Load(max_concurrency=2, request_rate=float("inf"), seed=0))
    assert sorted(b["prompt"] for b in server.bodies) == sorted(
        c.turns[0].text for c in conversations
    )
    for body in server.bodies:
        assert body["model"] == "m" and body["max_tokens"] == 4 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
    assert sorted(r.conversation for r in result.results) == [0, 1, 2, 3, 4]
    for r in result.results:
        assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 5 and len(r.itl) == 3
        assert 0 <= r.ttft <= r.e2e and r.tpot is not None


def test_warmups_go_first_one_at_a_time_and_stay_out_of_the_results():
    conversations = agentic_dataset(WordText(), 3, num_turns=2, system_len=0, turn_len=10,
                                    output_len=2, seed=0)  # fmt: skip
    server = FakeServer()
    result = server.run(conversations, Load(None, float("inf"), 0), warmups=2)
    firsts = [{"role": "user", "content": c.turns[0].text} for c in conversations[:2]]
    assert [b["messages"][-1] for b in server.bodies[:2]] == firsts  # before any timed one
    assert len(server.bodies) == 2 + 6 and len(result.results) == 6
    assert sorted((r.conversation, r.turn) for r in result.results) == [
        (c, t) for c in range(3) for t in range(2)
    ]


def test_agentic_turns_carry_the_whole_history_with_the_actual_replies():
    conversations = agentic_dataset(WordText(), 3, num_turns=4, system_len=50, turn_len=20,
                                    output_len=3, seed=0)  # fmt: skip
    server = FakeServer()
    result = server.run(conversations, Load(max_concurrency=2, request_rate=float("inf"), seed=0))
    assert len(result.results) == 12 and all(r.ok for r in result.results)
    assert all(r.output_tokens == 3 and r.text == "w0 w1 w2 " for r in result.results)
    reply = {"role": "assistant", "content": "w0 w1 w2 "}
    for index, conversation in enumerate(conversations):
        first = {"role": "user", "content": conversation.turns[0].text}
        sent = [b["messages"] for b in server.bodies if b["messages"][1] == first]
        assert len(sent) == 4
        assert sent[0] == [{"role": "system", "content": conversation.system}, first]
        for turn in range(1, 4):  # each request: the previous one, its reply, the new turn
            new = {"role": "user", "content": conversation.turns[turn].text}
            assert sent[turn] == [*sent[turn - 1], reply, new]
        turns = sorted(r.turn for r in result.results if r.conversation == index)
        assert turns == [0, 1, 2, 3]


def test_failed_requests_are_counted_by_kind_and_end_their_conversation():
    conversations = agentic_dataset(WordText(), 2, num_turns=3, system_len=0, turn_len=10,
                                    output_len=2, seed=0)  # fmt: skip
    second_turn_of_first = conversations[0].turns[1].text
    server = FakeServer(fail=lambda body: body["messages"][-1]["content"] == second_turn_of_first)
    result = server.run(conversations, Load(max_concurrency=None, request_rate=50.0, seed=0))
    summary = summarize(result, planned=6)
    assert summary["errors"] == {"http_500": 1}
    assert (summary["completed"], summary["failed"], summary["not_sent"]) == (4, 1, 1)


@pytest.fixture(scope="module")
def router():
    proc, m = start(["tools.serve", "--model", MODEL, "--port", "0", "--kv-cache-gb", "0.1"],
                    r"tandem ready: (http://\S+)", timeout=300)  # fmt: skip
    yield m.group(1)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def _bench(tmp_path, router: str, *args: str) -> dict:
    out = tmp_path / "results.json"
    plot = tmp_path / "latency.png"
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench.main", "--base-url", router, "--seed", "1",
         "--result-json", str(out), "--plot", str(plot), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "TTFT" in done.stdout and "requests" in done.stderr  # the table; the progress bar
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


def _assert_sane(results: dict, planned: int, output_len: int) -> None:
    summary = results["summary"]
    assert summary["errors"] == {} and summary["completed"] == planned, summary
    for record in results["requests"]:
        assert record["output_tokens"] == output_len
        assert 0 < record["ttft"] <= record["e2e"]
        assert len(record["itl"]) <= output_len - 1
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[metric]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (metric, stats)
    assert summary["output_throughput"] > 0


def test_random_load_against_the_tandem_stack(tmp_path, router):
    results = _bench(tmp_path, router, "--dataset", "random", "--num-prompts", "12",
                     "--max-concurrency", "4", "--random-input-len", "32",
                     "--random-output-len", "8", "--tokenizer", MODEL)  # fmt: skip
    _assert_sane(results, planned=12, output_len=8)
    assert all(r["prompt_tokens"] == 32 for r in results["requests"])
    phases = results["summary"]["server_phases_ms"]  # the router's, over the 12 timed requests
    # tandem's prefill times its own part in Server-Timing: the router records it too.
    own = {"prefill_queue", "prefill_forward", "prefill_send"}
    router = {"tokenize", "reserve", "prefill", "first_message", "router_ttft"}
    assert set(phases) == router | own, phases
    assert all(value > 0 for name, value in phases.items() if name != "prefill_queue")
    assert phases["prefill"] < phases["router_ttft"] < results["summary"]["ttft_ms"]["mean"]
    assert phases["prefill_forward"] + phases["prefill_send"] < phases["prefill"]
    assert results["config"]["model"] == "smollm2-135m-instruct"  # the first of GET /v1/models


def test_agentic_load_against_the_tandem_stack(tmp_path, router):
    results = _bench(tmp_path, router, "--dataset", "agentic", "--num-prompts", "3",
                     "--agentic-turns", "3", "--agentic-system-len", "64",
                     "--agentic-turn-len", "24", "--agentic-output-len", "6",
                     "--request-rate", "20")  # fmt: skip
    _assert_sane(results, planned=9, output_len=6)
    for conversation in range(3):
        turns = sorted((r["turn"], r["prompt_tokens"]) for r in results["requests"]
                       if r["conversation"] == conversation)  # fmt: skip
        prompts = [tokens for _, tokens in turns]
        assert len(prompts) == 3 and prompts == sorted(set(prompts)), prompts  # context grows
