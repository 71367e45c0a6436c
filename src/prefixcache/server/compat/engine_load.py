"""The server's load as routers read it: requests running and waiting, and how full the KV cache
is. One snapshot feeds both ``GET /v1/loads`` (SGLang's shape) and the ``vllm:`` gauges on
``/metrics`` (vLLM's names), so the two never disagree.

Only server-wide aggregates: no count here is split by tenant, and none says which prefixes are
cached, so a caller learns nothing of another tenant's traffic beyond the server's total load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """``running``: admitted requests the engine batches now (at most its ``max_batch``);
    ``waiting``: admitted requests beyond that, queued; ``kv_usage``: memory-cache bytes held
    over its budget (0.0-1.0); ``max_running``: the engine's batch size."""

    running: int
    waiting: int
    kv_usage: float
    used_bytes: int
    capacity_bytes: int
    max_running: int


def load_snapshot(depth: int, max_running: int, stats: Any | None) -> LoadSnapshot:
    """A :class:`LoadSnapshot` from the admission depth, the batch size and the cache's stats
    (None: no cache, usage 0)."""
    running = min(depth, max_running)
    used = int(getattr(stats, "bytes", 0) or 0)
    capacity = int(getattr(stats, "capacity_bytes", 0) or 0)
    usage = min(1.0, used / capacity) if capacity > 0 else 0.0
    return LoadSnapshot(running, depth - running, usage, used, capacity, max_running)


def sglang_loads(snap: LoadSnapshot, timestamp: str) -> dict[str, Any]:
    """SGLang's ``GET /v1/loads`` answer (one data-parallel rank): the fields SMG's load monitor
    reads (``num_running_reqs``, ``num_waiting_reqs``, ``token_usage``, ...)."""
    return {
        "timestamp": timestamp,
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": snap.running,
                "num_waiting_reqs": snap.waiting,
                "num_total_reqs": snap.running + snap.waiting,
                "token_usage": round(snap.kv_usage, 6),
                "max_running_requests": snap.max_running,
            }
        ],
    }


class VllmGauges(Collector):
    """vLLM's metric names beside the ``prefixcache_`` ones, for routers and dashboards built
    for vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc`` (a fraction, as in vLLM), ``vllm:prefix_cache_queries_total``
    and ``vllm:prefix_cache_hits_total`` (prompt tokens looked up / read from the cache),
    ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``; each labelled
    ``model_name`` and ``engine`` as vLLM labels them."""

    def __init__(
        self,
        model_name: str,
        load_fn: Callable[[], LoadSnapshot],
        stats_fn: Callable[[], Any | None],
        tokens_fn: Callable[[], tuple[float, float]],
    ) -> None:
        self._model = model_name
        self._load_fn = load_fn
        self._stats_fn = stats_fn
        self._tokens_fn = tokens_fn

    def describe(self) -> Iterator[Metric]:
        """The families without values: registering reads nothing of the engine."""
        labels = ["model_name", "engine"]
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            yield GaugeMetricFamily(f"vllm:{name}", "", labels=labels)
        for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens"):
            yield CounterMetricFamily(f"vllm:{name}", "", labels=labels)

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        values = [self._model, "0"]
        snap = self._load_fn()
        stats = self._stats_fn()
        prompt, generated = self._tokens_fn()
        gauges = (
            ("vllm:num_requests_running", "Requests in the engine's batch now.", snap.running),
            ("vllm:num_requests_waiting", "Requests admitted and waiting for the batch.", snap.waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage: 1 means full.", snap.kv_usage),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                getattr(stats, "queried_tokens", 0),
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens read from the prefix cache.",
                getattr(stats, "hit_tokens", 0),
            ),
            ("vllm:prompt_tokens", "Prompt tokens received.", prompt),
            ("vllm:generation_tokens", "Tokens generated.", generated),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value or 0))
            yield c
