"""From the requests' results to the benchmark's figures: latency percentiles, throughput and
errors by kind; printed as a table, written as JSON, and plotted as latency CDFs (PNG)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from tools.bench.client import RequestResult
from tools.bench.runner import RunResult

PERCENTILES = (50, 90, 99)
METRICS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (linear interpolation between ranks, as numpy and vLLM do); None
    for each when there are no values."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    points = np.percentile(values, PERCENTILES)
    return {
        "mean": float(np.mean(values)),
        **{f"p{q}": float(p) for q, p in zip(PERCENTILES, points, strict=True)},
    }


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF's steps: sorted values, and the fraction of values <= each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def latencies_ms(results: list[RequestResult]) -> dict[str, list[float]]:
    """Each metric's samples over the successful requests, in milliseconds; ITL pools every gap
    of every request."""
    ok = [r for r in results if r.ok]
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    return {name: [1000 * s for s in values] for name, values in samples.items()}


def summarize(run: RunResult, planned: int) -> dict:
    """The figures of a run in which `planned` requests were to be sent."""
    ok = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    errors = Counter(r.error for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error, r.detail)
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    duration = max(run.duration, 1e-9)
    latencies = latencies_ms(run.results)
    return {
        "planned": planned,
        "completed": len(ok),
        "failed": len(failed),
        "not_sent": planned - len(run.results),
        "errors": dict(sorted(errors.items())),
        "error_examples": dict(sorted(examples.items())),
        "duration_s": run.duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **{f"{name}_ms": percentiles(values) for name, values in latencies.items()},
        "server_phases_ms": run.server_phases_ms,
    }


def table(summary: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "none"
    lines = [
        f"{'requests completed':<28}{summary['completed']} of {summary['planned']}",
        f"{'failed / not sent':<28}{summary['failed']} / {summary['not_sent']}",
        f"{'errors':<28}{errors}",
        *(
            f"{'  e.g. ' + kind:<28}{detail[:200]}"
            for kind, detail in summary["error_examples"].items()
        ),
        f"{'duration (s)':<28}{summary['duration_s']:.2f}",
        f"{'input / output tokens':<28}{summary['input_tokens']} / {summary['output_tokens']}",
        f"{'requests/s':<28}{summary['request_throughput']:.2f}",
        f"{'output tokens/s':<28}{summary['output_throughput']:.1f}",
        f"{'total tokens/s':<28}{summary['total_token_throughput']:.1f}",
        f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, label in METRICS.items():
        stats = summary[f"{name}_ms"]
        lines.append(f"{label:<10}" + "".join(f"{ms(stats[k]):>10}" for k in stats))
    if phases := summary["server_phases_ms"]:
        means = ", ".join(f"{phase} {value:.2f}" for phase, value in phases.items())
        lines.append(f"{'server phases, mean ms':<28}{means}")
    return "\n".join(lines)


def records(results: list[RequestResult]) -> list[dict]:
    """One record per request sent, its text left out."""
    return [{k: v for k, v in asdict(r).items() if k != "text"} for r in results]


def write_json(path: Path, config: dict, summary: dict, results: list[RequestResult]) -> None:
    """The configuration, the summary, and the requests' `records`."""
    payload = {"config": config, "summary": summary, "requests": records(results)}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot_cdfs(path: Path, results: list[RequestResult], title: str) -> None:
    """A PNG of the four latency CDFs side by side."""
    figure = Figure(figsize=(16, 4), layout="constrained")
    figure.suptitle(title)
    latencies = latencies_ms(results)
    for axes, (name, label) in zip(figure.subplots(1, len(METRICS)), METRICS.items(), strict=True):
        xs, ys = cdf(latencies[name])
        axes.step(xs, ys, where="post")
        axes.set_title(label)
        axes.set_xlabel("ms")
        axes.set_ylabel("fraction of samples")
        axes.set_ylim(0, 1.02)
        axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)
