"""Replay a trace through the real PrefixCache on a simulated clock.

One :class:`~prefixcache.cache.PrefixCache` per replica (keys, store, TTL, LRU, pins: the same
code the engine runs), a :class:`~prefixcache.cache.FakeClock` set to each request's ``ts``, and
a :class:`~prefixcache.analysis.costs.CostModel` in place of the model runner (payload ``None``,
``nbytes = block_size * kv_bytes_per_token``). Each tenant gets its own namespace (salted), as
the server does.

Load model: a replica prefills one request at a time (FIFO); a request's estimated TTFT is its
wait for the replica plus its own uncached prefill at ``prefill_tps``. Decode is assumed to be
batched alongside and is not queued.

Routing (:data:`ROUTINGS`, the router's policies): round-robin and random (seeded) and
prefix-affinity (rendezvous hashing of the chained key of the tenant and the first K blocks) as
``prefixcache route`` places requests (:mod:`prefixcache.routing`); least-loaded (smallest
prefill backlog); cache-aware (the replica
whose cache holds the longest prefix, probed without touching; it moves to the least-loaded
replica when the wait there would cost more than the prefill the hit saves).

Keep-warm, as the router does it (:mod:`prefixcache.router.keepwarm`): a policy of one prefix per
chosen endpoint (the leading tokens of its first request), sent every ``keep_warm_interval_s``
(60 s) from the trace's start to every replica, whatever the routing, as ``POST /v1/cache/pin``:
prefilled through the real cache where it is missing, read where it is stored, and pinned.
Pinned blocks neither expire nor are evicted (the separate pinned budget,
``pinned_capacity_bytes``; a pin beyond it is refused and logged). The pin requests' reads are
counted and priced as cache reads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.config import ROUTINGS, SimConfig
from prefixcache.analysis.costs import CostBreakdown, TokenTotals, price, pricing_profile
from prefixcache.analysis.feed import TraceFeed, TraceUnsorted, can_stream, stream
from prefixcache.analysis.replay_loop import replay_requests
from prefixcache.analysis.sim_checks import break_even_rows, load_rows
from prefixcache.analysis.trace import Trace, load_trace
from prefixcache.analysis.trace.keychains import paused_gc
from prefixcache.cache import PrefixCache

log = logging.getLogger(__name__)

__all__ = [
    "ROUTINGS",
    "SimConfig",
    "SimResult",
    "load_keep_warm",
    "parse_sweep",
    "simulate",
    "simulate_file",
    "sweep",
]


@dataclass(slots=True)
class SimResult:
    """Totals, per-request arrays (for plots) and per-endpoint/replica breakdowns."""

    config: SimConfig
    totals: TokenTotals
    cached: np.ndarray  # int64 per request: tokens read from the cache
    written: np.ndarray  # int64 per request
    replica: np.ndarray  # int16 per request
    ttft_s: np.ndarray  # float64 per request (estimated)
    endpoints: list[dict[str, Any]]
    replicas: list[dict[str, Any]]
    keep_warm_refreshes: int
    costs: list[CostBreakdown]
    load: dict[str, Any] = field(default_factory=dict)  # replica load summary (sim_checks.load_rows)
    break_even: list[dict[str, Any]] = field(default_factory=list)  # per pricing profile

    @property
    def hit_rate(self) -> float:
        return self.totals.cached / self.totals.prompt if self.totals.prompt else 0.0

    @property
    def prefill_s(self) -> float:
        return self.config.cost.prefill_s(self.totals.uncached)

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        t = self.totals
        return {
            "config": {
                "ttl_s": c.ttl_s,
                "capacity_bytes": c.capacity_bytes,
                "block_size": c.block_size,
                "align_tokens": c.align_tokens or c.block_size,
                "replicas": c.replicas,
                "routing": c.routing,
                "keep_warm": c.keep_warm,
                "prefill_tps": c.cost.prefill_tps,
                "prefill_tps_source": c.cost.source,
                "kv_bytes_per_token": c.cost.kv_bytes_per_token,
                "kv_bytes_per_token_source": c.cost.kv_source,
            },
            "requests": len(self.cached),
            "hit_rate": self.hit_rate,
            "prompt_tokens": t.prompt,
            "cached_tokens": t.cached,
            "prefilled_tokens": t.uncached,
            "cache_write_tokens": t.written + t.written_long,
            "output_tokens": t.output,
            "prefill_s": self.prefill_s,
            "ttft_s": {**_pcts(self.ttft_s), "meaningful": not self.load.get("saturated", False)},
            "load": self.load,
            "keep_warm_refreshes": self.keep_warm_refreshes,
            "keep_warm_read_tokens": t.keep_warm_reads,
            "endpoints": self.endpoints,
            "replicas": self.replicas,
            "costs": [x.as_dict() for x in self.costs],
            "break_even": self.break_even,
        }


def _pcts(a: np.ndarray) -> dict[str, float]:
    if len(a) == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


def simulate(
    trace: Trace | TraceFeed, cfg: SimConfig, *, progress: Callable[[int], None] | None = None
) -> SimResult:
    """Replay ``trace`` under ``cfg``. Deterministic for a given trace and config.

    ``trace`` may be a :class:`~prefixcache.analysis.feed.TraceFeed` (a stream from a reader
    process: see :func:`simulate_file`) made with ``cfg.fingerprint`` and ``cfg.block_size``;
    keep-warm needs a loaded trace (it looks ahead to each endpoint's first request).

    The per-request loop is :mod:`~prefixcache.analysis.replay_loop`'s: work per request is
    O(runs on the prompt's path) in the cache, plus C-level copies of its new tokens and keys
    (and, for cache-aware routing, one walk per replica), never O(cache size).
    """
    if cfg.routing not in ROUTINGS:
        raise ValueError(f"unknown routing {cfg.routing!r}; choose one of {', '.join(ROUTINGS)}")
    if isinstance(trace, TraceFeed):
        feed = trace
        if (feed.fingerprint, feed.block_size) != (cfg.fingerprint, cfg.block_size):
            raise ValueError(
                "the feed's keys were made for another fingerprint or block size than the config's"
            )
        if cfg.keep_warm and not feed.complete:
            raise ValueError("keep-warm needs the whole trace loaded (load_trace), not a stream")
    else:
        feed = TraceFeed.of(trace, cfg.fingerprint, cfg.block_size)
    with paused_gc():
        return _simulate(feed, cfg, progress)


def simulate_file(
    path: str | Path,
    cfg: SimConfig,
    *,
    tokenizer: str | None = None,
    progress: Callable[[str, float, float], None] | None = None,
) -> SimResult:
    """:func:`simulate` of a trace file. Where it can (fork exists, no keep-warm), a reader process
    parses the file and computes the keys while this one replays (:func:`~prefixcache.analysis.feed.stream`);
    a trace too far out of time order for the reader's window is loaded whole instead.
    ``progress(stage, done, total)``: "reading" or "simulating", bytes of the file read (streams)
    or requests. Raises TraceFormatError naming a bad line."""
    if can_stream() and not cfg.keep_warm:
        try:
            feeds = stream(path, fingerprint=cfg.fingerprint, block_size=cfg.block_size, tokenizer=tokenizer)
        except OSError as exc:  # pragma: no cover - out of processes
            log.warning("simulate: cannot start a reader process (%s); loading the trace first", exc)
        else:
            with feeds[0] as feed:
                report = None
                if progress is not None:

                    def report(_i: int) -> None:
                        progress("simulating", feed.position, feed.size)

                try:
                    return simulate(feed, cfg, progress=report)
                except TraceUnsorted as exc:
                    log.info("%s; loading and sorting the whole trace instead", exc)
    trace = load_trace(
        path,
        tokenizer=tokenizer,
        progress=(lambda k: progress("reading", k, 0)) if progress is not None else None,
    )
    n = len(trace)
    report_requests = (lambda i: progress("simulating", i, n)) if progress is not None else None
    return simulate(trace, cfg, progress=report_requests)


def _simulate(feed: TraceFeed, cfg: SimConfig, progress: Callable[[int], None] | None) -> SimResult:
    """Replay ``feed``, then the result: totals, per-endpoint and per-replica rows, costs."""
    outcome = replay_requests(feed, cfg, progress)
    trace = feed.trace()
    totals = outcome.totals
    totals.prompt = int(trace.prompt_tokens.sum())
    totals.output = int(trace.output_tokens.sum())
    cached, written, replica, ttft = outcome.cached, outcome.written, outcome.replica, outcome.ttft_s
    totals.cached = int(cached.sum())
    load_by_replica, load = load_rows(trace, replica, cached, cfg.replicas, cfg.cost.prefill_tps)
    saturated = np.array([row["saturated"] for row in load_by_replica], dtype=bool)
    endpoints = _per_endpoint(trace, cached, written, ttft, saturated[replica])
    replicas = [
        {**_replica_row(trace, r, cache, replica == r, cached), **load_by_replica[r]}
        for r, cache in enumerate(outcome.caches)
    ]
    costs = [price(totals, pricing_profile(p, gpu_hour=cfg.gpu_hour), cfg.cost) for p in cfg.pricing]
    even = break_even_rows(trace, cached, written, cfg.pricing, cfg.ttl_s, cfg.gpu_hour)
    return SimResult(
        cfg,
        totals,
        cached,
        written,
        replica,
        ttft,
        endpoints,
        replicas,
        outcome.keep_warm_refreshes,
        costs,
        load,
        even,
    )


def _replica_row(
    trace: Trace, replica: int, cache: PrefixCache, routed: np.ndarray, cached: np.ndarray
) -> dict[str, Any]:
    stats = cache.stats()
    prompt_tokens = int(trace.prompt_tokens[routed].sum())
    return {
        "replica": replica,
        "requests": int(routed.sum()),
        "hit_rate": float(cached[routed].sum() / prompt_tokens) if prompt_tokens else 0.0,
        "blocks": stats.blocks,
        "bytes": stats.bytes,
        "evictions": stats.evictions,
    }


def _per_endpoint(
    trace: Trace, cached: np.ndarray, written: np.ndarray, ttft: np.ndarray, on_saturated: np.ndarray
) -> list[dict[str, Any]]:
    """Per endpoint; its TTFTs are not meaningful when any of its requests went to a saturated
    replica."""
    rows = []
    for endpoint, name in enumerate(trace.endpoints):
        mine = trace.endpoint == endpoint
        prompt_tokens = int(trace.prompt_tokens[mine].sum())
        rows.append(
            {
                "endpoint": name,
                "requests": int(mine.sum()),
                "prompt_tokens": prompt_tokens,
                "cached_tokens": int(cached[mine].sum()),
                "cache_write_tokens": int(written[mine].sum()),
                "hit_rate": float(cached[mine].sum() / prompt_tokens) if prompt_tokens else 0.0,
                "ttft_s": {**_pcts(ttft[mine]), "meaningful": not bool(on_saturated[mine].any())},
            }
        )
    return rows


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``ttl=60,300,900`` -> ("ttl", ["60", "300", "900"]); also capacity=, replicas=, block_size=."""
    name, _, vals = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in ("ttl", "capacity", "replicas", "block_size") or not vals:
        raise ValueError(
            f"--sweep {text!r}: use ttl=60,300,... or capacity=1GiB,4GiB,... (or replicas=, block_size=)"
        )
    return name, [v.strip() for v in vals.split(",") if v.strip()]


def sweep(
    trace: Trace,
    base: SimConfig,
    name: str,
    values: list[Any],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[SimResult]:
    """One :func:`simulate` per value of ``name`` (a SimConfig field: ttl_s, capacity_bytes, ...)."""
    out = []
    for v in values:
        out.append(simulate(trace, replace(base, **{name: v}), progress=progress))
    return out


def load_keep_warm(path: str | Path, trace: Trace) -> dict[str, int]:
    """Keep-warm prefixes from a file: the audit's ``--json`` output (endpoints whose
    ``keep_warm`` is true, with their ``keep_warm_prefix_tokens``) or lines ``endpoint=tokens``."""
    text = Path(path).read_text()
    out: dict[str, int] = {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "endpoints" in data:
        for e in data["endpoints"]:
            if e.get("keep_warm") and e.get("keep_warm_prefix_tokens"):
                out[str(e["endpoint"])] = int(e["keep_warm_prefix_tokens"])
        return out
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        ep, _, tok = line.partition("=")
        if not tok.strip().isdigit():
            raise ValueError(f"{path}: bad keep-warm line {line!r}; write endpoint=prefix_tokens")
        out[ep.strip()] = int(tok)
    unknown = set(out) - set(trace.endpoints)
    if unknown:
        log.warning("keep-warm endpoints not in the trace: %s", ", ".join(sorted(unknown)))
    return out
