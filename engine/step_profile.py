"""Where a decode step's time goes: engine steps run under torch.profiler, summarized by kernel.

On CUDA the summary is of what the device ran in those steps (kernels, copies, memsets; inside
CUDA graphs too): each one's time and launches per step, and the device's busy time per step,
the union of those intervals. Under programmatic dependent launch a kernel is resident, waiting,
while the one before it finishes, so the kernels' times add up to more than the step: the busy
time is the one to set against the wall time (the first event's start to the last one's end,
per step), and their difference is the time no kernel ran. On CPU the same is taken of the
top-level torch ops. The whole trace is written for a viewer (chrome://tracing, Perfetto).

`engine.bench --profile-steps N` runs it after each case's timed steps.
"""

from __future__ import annotations

import gzip
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

__all__ = ["KernelTime", "StepProfile", "profile_steps", "summarize"]


@dataclass(frozen=True)
class KernelTime:
    name: str
    us_per_step: float
    launches_per_step: float


@dataclass(frozen=True)
class StepProfile:
    steps: int
    tokens: int
    """Tokens the steps returned (with speculative decoding, up to k + 1 a sequence a step)."""
    wall_us_per_step: float
    busy_us_per_step: float
    kernels: list[KernelTime]
    """Longest first."""

    def table(self, top: int = 25) -> str:
        """The per-step figures, then the `top` longest kernels."""
        head = f"{self.steps} steps, {self.tokens} tokens: "
        if self.wall_us_per_step:
            busy = self.busy_us_per_step / self.wall_us_per_step
            head += f"{self.wall_us_per_step:.1f} us a step, busy {self.busy_us_per_step:.1f} us"
            head += f" ({busy:.1%})"
        else:
            head += "no events"
        lines = [head, f"{'us/step':>9} {'n/step':>7}  kernel"]
        for k in self.kernels[:top]:
            lines.append(f"{k.us_per_step:>9.1f} {k.launches_per_step:>7.2f}  {k.name[:120]}")
        return "\n".join(lines)


def summarize(spans: list[tuple[str, float, float]], steps: int, tokens: int) -> StepProfile:
    """The profile of `steps` steps from their events' (name, start us, end us)."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, start, end in spans:
        per_name[name][0] += end - start
        per_name[name][1] += 1
    busy, covered = 0.0, None  # the union of the intervals, in start order
    for _, start, end in sorted(spans, key=lambda s: s[1]):
        if covered is None or start >= covered:
            busy += end - start
            covered = end
        elif end > covered:
            busy += end - covered
            covered = end
    wall = max(e for _, _, e in spans) - min(s for _, s, _ in spans) if spans else 0.0
    kernels = [
        KernelTime(name, total / steps, count / steps)
        for name, (total, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0])
    ]
    return StepProfile(steps, tokens, wall / steps, busy / steps, kernels)


def profile_steps(engine: LLMEngine, steps: int, trace: Path | None = None) -> StepProfile:
    """Runs `steps` engine steps under the profiler (every sequence must have room for them)
    and summarizes them; `trace`: where the whole trace goes (gzipped where it ends in .gz)."""
    cuda = engine.config.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    tokens = 0
    with profile(activities=activities) as prof:
        for _ in range(steps):
            tokens += len(engine.step())
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        _export(prof, trace)
    return summarize(_spans(prof.events(), cuda), steps, tokens)


def _spans(events, cuda: bool) -> list[tuple[str, float, float]]:
    """The device's events on CUDA, the top-level ops' on CPU."""
    if cuda:
        chosen = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        chosen = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    return [(e.name, e.time_range.start, e.time_range.end) for e in chosen]


def _export(prof: profile, trace: Path) -> None:
    trace.parent.mkdir(parents=True, exist_ok=True)
    if trace.suffix != ".gz":
        prof.export_chrome_trace(str(trace))
        return
    plain = trace.with_suffix("")
    prof.export_chrome_trace(str(plain))
    with plain.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()
