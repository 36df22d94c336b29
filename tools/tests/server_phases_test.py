"""The benchmark's reading of a server's phase histogram (tools/bench/server_phases.py), on the
text prometheus_client writes for tandem's router."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tools.bench import server_phases


def test_means_are_over_what_was_counted_between_two_readings():
    registry = CollectorRegistry()
    phases = Histogram(server_phases.PHASE_METRIC, "steps", ["phase"], registry=registry)
    ttft = Histogram(server_phases.TTFT_METRIC, "first token", registry=registry)
    phases.labels("reserve").observe(9.0)  # before the run (a warm-up): left out
    ttft.observe(10.0)
    before = server_phases.parse(generate_latest(registry).decode())
    for seconds in (0.002, 0.004):
        phases.labels("reserve").observe(seconds)
    phases.labels("prefill").observe(0.3)
    ttft.observe(0.31)
    after = server_phases.parse(generate_latest(registry).decode())
    assert after["reserve"] == (pytest.approx(9.006), 3.0)
    means = server_phases.means_ms(before, after)
    assert means == {"prefill": pytest.approx(300.0), "reserve": pytest.approx(3.0),
                     "router_ttft": pytest.approx(310.0)}  # fmt: skip
    assert server_phases.means_ms(after, after) == {}  # nothing counted in between


def test_a_server_without_the_histogram_reports_no_phase():
    assert server_phases.parse("vllm:num_requests_running 0.0\n# HELP x y\n") == {}
