"""Prometheus metrics, on a registry per app (several apps can live in one process).

Per request (counted by the server when a generation finishes):
``prefixcache_prompt_tokens_total``, ``prefixcache_cached_tokens_total``,
``prefixcache_cache_write_tokens_total``, ``prefixcache_completion_tokens_total``,
``prefixcache_ttft_seconds{outcome}`` (``hit``: every reusable block came from the cache,
``partial``: some, ``miss``: none) and ``prefixcache_prefill_seconds_saved_total`` (cached tokens
divided by the prefill rate measured on this server's own misses: uncached prompt tokens / TTFT).
``prefixcache_cache_read_reasons_total{reason}`` counts requests by why their cache read ended
where it did, and ``prefixcache_cache_missed_tokens_total{reason}`` the tokens that would have
been read but for it (see ``prefixcache.cache.reasons``).

Per HTTP request: ``prefixcache_requests_total{route,status}``.

vLLM's names for routers built for vLLM (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
...) are registered beside these by the app (``server/compat/engine_load.py``).

Read from the cache at scrape time: ``prefixcache_cache_blocks``, ``prefixcache_cache_bytes``,
``prefixcache_cache_hit_ratio`` (cached / prompt tokens since start), and
``prefixcache_evictions_total{reason}`` (``capacity``, ``ttl``, ``flush``).
``prefixcache_queue_depth``: generation requests admitted and not finished (running or waiting).
``prefixcache_prefilled_tokens_total``: prompt tokens the engine computed (not read from the
cache), read from the engine's own counter: a request with ``n`` choices counts its prompt once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.cache.reasons import Reason
from prefixcache.server.bridge import Usage

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _CacheCollector(Collector):
    """Reads the cache's own counters when Prometheus scrapes (no double bookkeeping)."""

    def __init__(self, stats_fn: Callable[[], Any | None]) -> None:
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        blocks = GaugeMetricFamily(
            "prefixcache_cache_blocks", "Blocks held in the memory cache (pinned included)."
        )
        nbytes = GaugeMetricFamily(
            "prefixcache_cache_bytes", "Bytes held in the memory cache (pinned included)."
        )
        ratio = GaugeMetricFamily(
            "prefixcache_cache_hit_ratio", "Share of prompt tokens read from the cache since start."
        )
        evictions = CounterMetricFamily(
            "prefixcache_evictions", "Blocks removed from the cache, by reason.", labels=["reason"]
        )
        if stats is not None:
            blocks.add_metric([], stats.blocks)
            nbytes.add_metric([], stats.bytes)
            ratio.add_metric([], stats.hit_rate)
            for reason in sorted(set(stats.evictions) | {"capacity", "ttl", "flush"}):
                evictions.add_metric([reason], stats.evictions.get(reason, 0))
        else:
            blocks.add_metric([], 0)
            nbytes.add_metric([], 0)
            ratio.add_metric([], 0.0)
        yield from (blocks, nbytes, ratio, evictions)


class _PrefillCollector(Collector):
    """The engine's prefilled-token counter, read when Prometheus scrapes."""

    def __init__(self, prefilled_fn: Callable[[], int]) -> None:
        self._prefilled_fn = prefilled_fn

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "prefixcache_prefilled_tokens", "Prompt tokens computed by the engine (not read from the cache)."
        )
        family.add_metric([], self._prefilled_fn())
        yield family


class Metrics:
    """All of one app's metrics. Thread-safe (prometheus_client metrics are)."""

    def __init__(
        self,
        stats_fn: Callable[[], Any | None],
        queue_depth_fn: Callable[[], int],
        prefilled_fn: Callable[[], int] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("prefixcache_prompt_tokens", "Prompt tokens received.", registry=r)
        self.cached_tokens = Counter(
            "prefixcache_cached_tokens", "Prompt tokens read from the cache.", registry=r
        )
        self.cache_write_tokens = Counter(
            "prefixcache_cache_write_tokens", "Prompt tokens prefilled and written to the cache.", registry=r
        )
        self.completion_tokens = Counter("prefixcache_completion_tokens", "Tokens generated.", registry=r)
        self.cache_missed_tokens = Counter(
            "prefixcache_cache_missed_tokens",
            "Prompt tokens that would have been read from the cache but for the reason the read ended "
            "(expired, evicted, flushed, diverged, tier_unavailable).",
            ["reason"],
            registry=r,
        )
        self.cache_reads = Counter(
            "prefixcache_cache_read_reasons",
            "Generation requests by why their cache read ended where it did.",
            ["reason"],
            registry=r,
        )
        for reason in Reason:
            self.cache_missed_tokens.labels(reason=reason.value)
            self.cache_reads.labels(reason=reason.value)
        self.requests = Counter(
            "prefixcache_requests", "HTTP requests by route and status code.", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "prefixcache_ttft_seconds",
            "Time to first token, by cache outcome.",
            ["outcome"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefill_saved = Counter(
            "prefixcache_prefill_seconds_saved",
            "Estimated prefill seconds saved: cached tokens / measured prefill rate.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "prefixcache_queue_depth", "Generation requests admitted and not finished.", registry=r
        )
        self.queue_depth.set_function(lambda: float(queue_depth_fn()))
        for outcome in ("hit", "partial", "miss"):
            self.ttft.labels(outcome=outcome)
        r.register(_CacheCollector(stats_fn))
        if prefilled_fn is not None:
            r.register(_PrefillCollector(prefilled_fn))
        self._lock = threading.Lock()
        self._prefill_tokens = 0  # uncached prompt tokens over ...
        self._prefill_seconds = 0.0  # ... the TTFT they took: the measured prefill rate

    def observe(self, usage: Usage, ttft_s: float | None, outcome: str) -> None:
        """Count one finished generation."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.cache_write_tokens.inc(usage.cache_write_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        reason = usage.cache_reason
        if reason is not None:
            self.cache_reads.labels(reason=reason.reason.value).inc()
            if reason.cache_missed_tokens:
                self.cache_missed_tokens.labels(reason=reason.reason.value).inc(reason.cache_missed_tokens)
        if ttft_s is None:
            return
        self.ttft.labels(outcome=outcome).observe(ttft_s)
        with self._lock:
            computed = usage.prompt_tokens - usage.cached_tokens
            if computed > 0 and ttft_s > 0:
                self._prefill_tokens += computed
                self._prefill_seconds += ttft_s
            rate = self._prefill_tokens / self._prefill_seconds if self._prefill_seconds else 0.0
        if rate > 0 and usage.cached_tokens:
            self.prefill_saved.inc(usage.cached_tokens / rate)

    def missed_tokens(self) -> dict[str, int]:
        """``prefixcache_cache_missed_tokens_total`` by reason, the reasons that cost tokens only."""
        out: dict[str, int] = {}
        for family in self.cache_missed_tokens.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value > 0:
                    out[sample.labels["reason"]] = int(sample.value)
        return out

    @staticmethod
    def total(counter: Counter) -> float:
        """An unlabelled counter's value (its ``_total`` sample)."""
        for family in counter.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    return float(sample.value)
        return 0.0

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
