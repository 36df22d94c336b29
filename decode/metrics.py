"""Prometheus metrics of one decode server (their own registry, so several servers can live in
one process, as they do in tests)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from engine.prefix_cache import PrefixCache
from engine.speculative import SpecStats


class DecodeMetrics:
    def __init__(
        self,
        gauges: dict[str, Callable[[], float]],
        spec_stats: SpecStats | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`gauges`: name suffix -> a function read at scrape time (pool and queue sizes);
        `spec_stats`: the engine's speculation counters, when it speculates; `prefix_cache`:
        its prefix cache's, when it has one."""
        self.registry = CollectorRegistry()
        if spec_stats is not None:
            self.registry.register(_SpecCollector(spec_stats))
        if prefix_cache is not None:
            self.registry.register(_PrefixCacheCollector(prefix_cache))
        help_text = {
            "kv_blocks_total": "KV blocks in the pool",
            "kv_blocks_free": "KV blocks free",
            "kv_blocks_quarantined": "KV blocks held back for a writer that may still write",
            "running": "sequences in the running batch",
            "waiting": "sequences admitted and waiting for blocks or a batch slot",
            "reserved": "tickets waiting for their KV",
            "engine_up": "1 while the engine steps; 0 once it has failed (restart the server)",
        }
        for name, read in gauges.items():
            gauge = Gauge(f"tandem_decode_{name}", help_text[name], registry=self.registry)
            gauge.set_function(read)
        self.tokens_generated = Counter(
            "tandem_decode_tokens_generated", "tokens generated", registry=self.registry
        )
        self.transfer_bytes = Counter(
            "tandem_decode_transfer_bytes",
            "KV bytes committed by senders, by the sender's rank (a tensor-parallel prefill "
            "has one sender per rank)",
            ["sender_rank"],
            registry=self.registry,
        )
        self.local_prefills = Counter(
            "tandem_decode_local_prefills",
            "requests whose prompt this server prefilled itself (Generate with local_prefill)",
            registry=self.registry,
        )
        self.handover_seconds = Histogram(
            "tandem_decode_handover_seconds",
            "Generate call to its first token: waiting for commits, admission, first token",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )


class _SpecCollector(Collector):
    """Speculative decoding's counters, read from the engine's SpecStats at scrape time (vLLM's
    spec_decode metrics, under tandem_decode_spec_)."""

    def __init__(self, stats: SpecStats) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats
        for name, doc, value in (
            ("drafts", "verified proposals (sequence-steps that fed drafts)", stats.num_drafts),
            ("draft_tokens", "draft tokens proposed and verified", stats.num_draft_tokens),
            ("accepted_tokens", "draft tokens the target accepted", stats.num_accepted_tokens),
        ):
            yield CounterMetricFamily(f"tandem_decode_spec_{name}", doc, value=value)
        per_position = CounterMetricFamily(
            "tandem_decode_spec_accepted_tokens_per_pos",
            "proposals whose draft at this position was accepted",
            labels=["position"],
        )
        for position, count in enumerate(list(stats.accepted_per_position)):
            per_position.add_metric([str(position)], count)
        yield per_position


class _PrefixCacheCollector(Collector):
    """Prefix caching's counters at scrape time (vLLM's prefix_cache_queries and _hits)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self):
        for name, doc, value in (
            ("queries", "tokens of admitted prompts looked up", self.cache.queried_tokens),
            ("hits", "of those, tokens whose KV was cached", self.cache.hit_tokens),
        ):
            yield CounterMetricFamily(f"tandem_decode_prefix_cache_{name}", doc, value=value)
