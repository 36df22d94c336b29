"""Tests of the benchmark's named scenarios (tools/bench/scenarios.py): the levels a scenario
expands to, a sweep run level by level (against the fake server) with its table and JSON, and
the comparison of two runs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tools.bench.config import BenchConfig
from tools.bench.main import run_scenario
from tools.bench.runner import Load
from tools.bench.scenarios import compare_table, level_configs
from tools.tests.fake_openai import FakeServer


def test_8k1k_sweeps_concurrency_with_four_requests_a_slot():
    levels = level_configs(BenchConfig(seed=3), "8k1k", None, context=0)
    assert [c.max_concurrency for c in levels] == [1, 4, 16, 64]
    assert [c.num_prompts for c in levels] == [8, 16, 64, 256]
    assert {(c.dataset, c.random_input_len, c.random_output_len, c.seed) for c in levels} == {
        ("random", 8192, 1024, 3)
    }
    assert [c.max_concurrency for c in level_configs(BenchConfig(), "8k1k", [2], 0)] == [2]


def test_agentic_turns_grow_the_context_to_the_target():
    (level,) = level_configs(BenchConfig(), "agentic", [1], context=32768)
    assert (level.dataset, level.agentic_turns, level.num_prompts) == ("agentic", 8, 4)
    total = level.agentic_system_len + 8 * (level.agentic_turn_len + level.agentic_output_len)
    assert 32768 - 8 <= total <= 32768
    with pytest.raises(ValueError, match="context: 3000 tokens cannot hold"):
        level_configs(BenchConfig(), "agentic", None, context=3000)
    with pytest.raises(ValueError, match="concurrencies"):
        level_configs(BenchConfig(), "8k1k", [4, 0], context=0)


def test_a_sweep_runs_each_level_and_writes_them_all(tmp_path, capsys):
    server = FakeServer()
    concurrencies = []

    async def bench(config, conversations):
        concurrencies.append(config.max_concurrency)
        load = Load(config.max_concurrency, config.request_rate, config.seed)
        return "m", await server.serve(conversations, load)

    out = tmp_path / "sweep.json"
    base = BenchConfig(result_json=str(out))
    sweep = level_configs(base, "8k1k", [1, 2], context=0)
    sweep = [dataclasses.replace(c, random_input_len=16, random_output_len=3) for c in sweep]
    levels = run_scenario("8k1k", base, sweep, bench)
    assert concurrencies == [1, 2] and len(server.bodies) == 8 + 8
    written = json.loads(out.read_text())
    assert written["scenario"] == "8k1k" and written["levels"] == json.loads(json.dumps(levels))
    for level in written["levels"]:
        assert level["summary"]["completed"] == 8 and level["summary"]["output_tokens"] == 24
        assert len(level["requests"]) == 8
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[-2].split()[:3] == ["1", "8", "0"] and rows[-1].split()[:3] == ["2", "8", "0"]


def _run(levels: dict[int, tuple[float, float]]) -> dict:
    """A sweep's JSON with, per concurrency, its output tok/s and TTFT p50."""
    stats = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0}
    return {"levels": [
        {"concurrency": c, "summary": {
            "output_throughput": tok_s, "ttft_ms": {**stats, "p50": ttft}, "tpot_ms": stats,
            "itl_ms": stats}}
        for c, (tok_s, ttft) in levels.items()
    ]}  # fmt: skip


def test_compare_shows_the_levels_both_runs_have_with_b_over_a():
    text = compare_table(_run({1: (100.0, 50.0), 4: (300.0, 80.0)}),
                         _run({1: (120.0, 40.0), 16: (900.0, 90.0)}), "agg", "disagg")  # fmt: skip
    lines = text.splitlines()
    assert lines[0].split() == ["conc", "metric", "agg", "disagg", "B", "/", "A"]
    assert all(line.split()[0] == "1" for line in lines[1:])  # 4 and 16 are not in both
    throughput = next(line for line in lines if "output tok/s" in line)
    assert throughput.split()[-3:] == ["100.00", "120.00", "1.200"]
    ttft = next(line for line in lines if "TTFT p50" in line)
    assert ttft.split()[-1] == "0.800"


def test_compare_refuses_a_result_that_is_not_a_sweep_naming_it(tmp_path):
    from tools.bench.main import main

    sweep, single = tmp_path / "sweep.json", tmp_path / "single.json"
    sweep.write_text(json.dumps(_run({1: (100.0, 50.0)})))
    single.write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit, match=r"single\.json is not a scenario run's result"):
        main(["--compare", str(sweep), str(single)])
