"""What the server says each request's steps took: tandem's router exports a histogram
`tandem_router_phase_seconds{phase=...}` (tokenize, reserve, prefill, first_message,
local_prefill, ...) and its own time to first token, `tandem_router_ttft_seconds` (from the
prompt's ids to the first token), on /metrics; the benchmark reads them after its warm-ups and
after the run and reports each one's mean over the run's requests (the TTFT as `router_ttft`:
what the client's TTFT adds to it is the HTTP and the tokenization). A server without them
(vLLM, or no /metrics) reports none."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

PHASE_METRIC = "tandem_router_phase_seconds"
TTFT_METRIC = "tandem_router_ttft_seconds"

Totals = dict[str, tuple[float, float]]
"""phase -> (seconds summed, requests counted)."""


def parse(text: str) -> Totals:
    """The phases' sums and counts in a Prometheus text exposition."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (PHASE_METRIC, TTFT_METRIC):
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix(family.name + "_")
            phase = sample.labels.get("phase") if family.name == PHASE_METRIC else "router_ttft"
            if kind in ("sum", "count") and phase:
                found.setdefault(phase, {})[kind] = sample.value
    return {
        phase: (values["sum"], values["count"])
        for phase, values in found.items()
        if "sum" in values and "count" in values
    }


def means_ms(before: Totals, after: Totals) -> dict[str, float]:
    """Each phase's mean in milliseconds over what was counted between the two readings."""
    means = {}
    for phase, (seconds, count) in sorted(after.items()):
        seconds_before, count_before = before.get(phase, (0.0, 0.0))
        if count > count_before:
            means[phase] = 1000 * (seconds - seconds_before) / (count - count_before)
    return means


async def read(http: httpx.AsyncClient) -> Totals:
    """The server's phase totals now; none where it exports no such metric."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    return parse(response.text) if response.status_code == 200 else {}
