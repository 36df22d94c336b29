"""The prefill's `Server-Timing` header (the W3C format, durations in ms): written by its
replies, read by the handover bench: {"queue": 0.1, "forward": 30.2} <->
"queue;dur=0.100, forward;dur=30.200"."""


def header(phases: dict[str, float]) -> str:
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in phases.items())


def parse(value: str) -> dict[str, float]:
    """The phases of a header written by `header` (parameters other than dur are ignored)."""
    phases = {}
    for part in value.split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name and duration:
            phases[name] = float(duration.partition(";")[0])
    return phases
