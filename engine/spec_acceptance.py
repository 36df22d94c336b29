"""Simulated acceptance for speculative-decoding benchmarks.

Random weights accept almost no drafts, and short sweeps on real weights do not reach a
workload's acceptance; a benchmark instead names a committed curve (engine/acceptance_curves.json)
and the verifier accepts as many drafts as the curve draws. A curve gives, per draft position j,
the probability that draft j is accepted given every draft before it was; the mean acceptance
length (accepted drafts + the target's token) follows. Each sequence draws from a stream of its
own, one draw per verification of it: what it accepts does not depend on what rides along in
its steps, or on when they are launched. Output tokens are then not the target's:
`EngineConfig.benchmark_mode` must be set, and a curve that is missing, or shorter than the
configured depth, is a start-up error.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

CURVES_FILE = Path(__file__).with_name("acceptance_curves.json")


@dataclass
class AcceptanceCurve:
    name: str
    rates: tuple[float, ...]
    """Conditional acceptance probability of draft position 0, 1, ..."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or not all(0.0 <= r <= 1.0 for r in self.rates):
            raise ValueError(f"acceptance curve {self.name!r}: rates {self.rates} not in [0, 1]")

    @classmethod
    def load(cls, name: str, depth: int, seed: int = 0) -> AcceptanceCurve:
        """The committed curve `name`, checked to cover `depth` draft positions."""
        curves = json.loads(CURVES_FILE.read_text())
        if name not in curves:
            raise ValueError(
                f"speculative_config.acceptance_curve: {name!r} is not in {CURVES_FILE.name} "
                f"(known: {', '.join(sorted(curves))})"
            )
        rates = tuple(curves[name]["acceptance_rate_per_position"])
        if len(rates) < depth:
            raise ValueError(
                f"speculative_config.acceptance_curve: {name!r} covers {len(rates)} draft "
                f"positions, num_speculative_tokens is {depth}"
            )
        return cls(name, rates, seed)

    @property
    def mean_length(self) -> float:
        """Expected accepted drafts + 1 at the curve's full depth."""
        mean, reach = 1.0, 1.0
        for rate in self.rates:
            reach *= rate
            mean += reach
        return mean

    def draw(self, num_drafts: int, seq_id: str, index: int) -> int:
        """Accepted drafts of a step that fed `num_drafts` (<= the curve's depth), the
        `index`th verification of sequence `seq_id`. min(draw(n), m) equals draw(m) (a
        verification planned ahead clips it on the device)."""
        stream = random.Random((self.seed << 64) ^ (zlib.crc32(seq_id.encode()) << 32) ^ index)
        uniforms = [stream.random() for _ in self.rates]
        for j in range(num_drafts):
            if uniforms[j] >= self.rates[j]:
                return j
        return num_drafts
