"""The router's Prometheus metrics (their own registry, served on GET /metrics)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from router.generation import Finished, PromptLogprobs, Tokens
from router.limiter import InFlightLimiter
from router.orchestrator import Orchestrator

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self, orchestrator: Orchestrator, limiter: InFlightLimiter) -> None:
        self.orchestrator = orchestrator
        self.limiter = limiter
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tandem_router_requests", "requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.errors = Counter("tandem_router_errors", "errors by kind", ["kind"], registry=r)
        self.in_flight = Gauge("tandem_router_in_flight", "requests being served", registry=r)
        self.ttft = Histogram("tandem_router_ttft_seconds", "time to first token",
                              buckets=_LATENCY, registry=r)  # fmt: skip
        self.itl = Histogram("tandem_router_itl_seconds", "time between streamed tokens",
                             buckets=_LATENCY, registry=r)  # fmt: skip
        self.tpot = Histogram("tandem_router_tpot_seconds", "time per output token after the "
                              "first", buckets=_LATENCY, registry=r)  # fmt: skip
        self.e2e = Histogram("tandem_router_e2e_seconds", "request latency",
                             buckets=_LATENCY, registry=r)  # fmt: skip
        self.decode_load = Gauge("tandem_router_decode_outstanding_tokens",
                                 "tokens still to generate, per decode instance", ["instance"],
                                 registry=r)  # fmt: skip
        self.prefill_load = Gauge("tandem_router_prefill_in_flight",
                                  "prefill calls in flight, per prefill instance", ["instance"],
                                  registry=r)  # fmt: skip
        self.phases = Histogram(
            "tandem_router_phase_seconds", "a request's steps as the router waits on them: "
            "tokenize (the prompt rendered and tokenized, or given as ids), "
            "reserve (the decode server's Reserve), prefill (the prefill's reply: its "
            "forward, KV send and commit; where the prefill times them in Server-Timing, also "
            "prefill_queue, prefill_forward and prefill_send as it counts them), first_message "
            "(Generate to its first message), "
            "local_prefill (the same where the decode server prefills: aggregated)",
            ["phase"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        orchestrator.on_phase = lambda phase, seconds: self.phases.labels(phase).observe(seconds)
        r.register(_FallbackCollector(orchestrator))

    def count_response(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels("bad_request" if status < 500 else "backend").inc()

    def scrape(self) -> bytes:
        self.in_flight.set(self.limiter.active)
        for decode in self.orchestrator.decodes:
            self.decode_load.labels(decode.address).set(decode.outstanding_tokens)
        for prefill in self.orchestrator.prefills:
            self.prefill_load.labels(prefill.url).set(prefill.in_flight)
        return generate_latest(self.registry)


class _FallbackCollector:
    """tandem_router_decode_only_fallback_total, read from the orchestrator at scrape time (it
    counts as it routes: router/decode_only.py)."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    def collect(self):
        yield CounterMetricFamily(
            "tandem_router_decode_only_fallback",
            "requests prefilled by their decode server because no prefill instance was healthy",
            value=self.orchestrator.decode_only.fallback_requests,
        )


class RequestTimer:
    """Token timings of one request, recorded into the histograms as they happen."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def tokens_arrived(self, count: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        elif self.last is not None:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += count

    async def timed(
        self, stream: AsyncIterator[Tokens | Finished | PromptLogprobs]
    ) -> AsyncIterator[Tokens | Finished | PromptLogprobs]:
        """`stream` passed through, its token lists timed as they arrive; `done` once it ends
        or is closed (which closes `stream`)."""
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if isinstance(item, Tokens):
                        self.tokens_arrived(len(item.ids))
                    yield item
        finally:
            self.done()

    def done(self) -> None:
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.start)
        if self.first is not None and self.tokens > 1:
            self.metrics.tpot.observe((now - self.first) / (self.tokens - 1))
