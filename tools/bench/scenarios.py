"""Named serving scenarios: a dataset shape and a concurrency sweep, run one level after another
against the same server, and the table comparing two such runs (e.g. disaggregated against
aggregated, or tandem against vLLM).

- `8k1k`: random prompts of 8,192 tokens, 1,024 output tokens each, at concurrency 1, 4, 16 and
  64 (the reference system's InferenceX runs). Each level sends 4 requests per slot (at least 8).
- `agentic`: multi-turn coding-agent conversations whose last turn's context reaches `context`
  tokens (32,768 unless given): a 2,000-token system prompt, 8 turns, 200 output tokens a turn,
  each turn's new message sized so that the history grows to the target. Concurrency 1, 4 and
  16, 2 conversations per slot (at least 4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tools.bench.config import BenchConfig


@dataclass(frozen=True)
class Scenario:
    dataset: str
    concurrencies: tuple[int, ...]
    per_slot: int
    """Requests (random) or conversations (agentic) a level sends per concurrency slot."""
    minimum: int
    """... and at least this many."""


SCENARIOS = {
    "8k1k": Scenario("random", (1, 4, 16, 64), per_slot=4, minimum=8),
    "agentic": Scenario("agentic", (1, 4, 16), per_slot=2, minimum=4),
}
AGENTIC_TURNS = 8
AGENTIC_SYSTEM_LEN = 2000
AGENTIC_OUTPUT_LEN = 200


def level_configs(
    base: BenchConfig, name: str, concurrencies: Sequence[int] | None, context: int
) -> list[BenchConfig]:
    """One configuration per concurrency level of scenario `name` (its own levels unless
    `concurrencies`), the rest of `base` kept. ValueError for a context too short to hold the
    agentic turns."""
    scenario = SCENARIOS[name]
    if scenario.dataset == "random":
        shape = dict(random_input_len=8192, random_output_len=1024)
    else:
        fixed = AGENTIC_SYSTEM_LEN + AGENTIC_TURNS * AGENTIC_OUTPUT_LEN
        turn_len = (context - fixed) // AGENTIC_TURNS
        if turn_len < 1:
            raise ValueError(f"context: {context} tokens cannot hold the agentic turns (> {fixed})")
        shape = dict(agentic_turns=AGENTIC_TURNS, agentic_system_len=AGENTIC_SYSTEM_LEN,
                     agentic_turn_len=turn_len, agentic_output_len=AGENTIC_OUTPUT_LEN)  # fmt: skip
    levels = concurrencies or scenario.concurrencies
    if any(level < 1 for level in levels):
        raise ValueError(f"concurrencies: {list(levels)} must all be >= 1")
    return [
        dataclasses.replace(
            base,
            dataset=scenario.dataset,
            max_concurrency=level,
            num_prompts=max(scenario.minimum, scenario.per_slot * level),
            **shape,
        )
        for level in levels
    ]


# The sweep's columns: (label, summary key, statistic or None for a plain number, format).
COLUMNS = (
    ("conc", None, None, "{:>5}"),
    ("done", "completed", None, "{:>5}"),
    ("fail", "failed", None, "{:>5}"),
    ("req/s", "request_throughput", None, "{:>7.2f}"),
    ("out tok/s", "output_throughput", None, "{:>10.1f}"),
    ("TTFT p50", "ttft_ms", "p50", "{:>9.1f}"),
    ("TTFT p90", "ttft_ms", "p90", "{:>9.1f}"),
    ("TTFT p99", "ttft_ms", "p99", "{:>9.1f}"),
    ("TPOT p50", "tpot_ms", "p50", "{:>9.2f}"),
    ("TPOT p90", "tpot_ms", "p90", "{:>9.2f}"),
    ("ITL p99", "itl_ms", "p99", "{:>9.2f}"),
)


def sweep_table(levels: Sequence[dict]) -> str:
    """One row per level ({"concurrency", "summary"}), latencies in ms."""
    header = " ".join(f"{label:>{len(fmt.format(0))}}" for label, _, _, fmt in COLUMNS)
    rows = [header]
    for level in levels:
        cells = []
        for _, key, stat, fmt in COLUMNS:
            value = level["concurrency"] if key is None else level["summary"][key]
            value = value[stat] if stat is not None else value
            width = len(fmt.format(0))
            cells.append("-".rjust(width) if value is None else fmt.format(value))
        rows.append(" ".join(cells))
    for level in levels:  # where the server times its steps (tandem's router)
        if phases := level["summary"].get("server_phases_ms"):
            means = ", ".join(f"{phase} {value:.1f}" for phase, value in phases.items())
            rows.append(f"conc {level['concurrency']}: server phases, mean ms: {means}")
    return "\n".join(rows)


# What the comparison shows of each level: (label, summary key, statistic).
COMPARED = (
    ("output tok/s", "output_throughput", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p90 ms", "ttft_ms", "p90"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("TPOT p90 ms", "tpot_ms", "p90"),
    ("ITL p99 ms", "itl_ms", "p99"),
)


def compare_table(a: dict, b: dict, a_name: str = "A", b_name: str = "B") -> str:
    """Two sweeps' results (as written by --result-json) side by side, level by level where
    both have the level, with B / A."""
    by_level = {level["concurrency"]: level["summary"] for level in b["levels"]}
    lines = [f"{'conc':>5} {'metric':<14} {a_name:>12} {b_name:>12} {'B / A':>8}"]
    for level in a["levels"]:
        other = by_level.get(level["concurrency"])
        if other is None:
            continue
        for label, key, stat in COMPARED:
            x, y = level["summary"][key], other[key]
            x, y = (x[stat], y[stat]) if stat is not None else (x, y)
            ratio = "-" if not x or y is None else f"{y / x:.3f}"
            cells = ("-" if v is None else f"{v:.2f}" for v in (x, y))
            lines.append(f"{level['concurrency']:>5} {label:<14} " + " ".join(
                f"{c:>12}" for c in cells) + f" {ratio:>8}")  # fmt: skip
    return "\n".join(lines)
