"""Replay a trace through the real PrefixCache on a simulated clock.

One :class:`~prefixcache.cache.PrefixCache` per replica (keys, store, TTL, LRU, pins: the same
code the engine runs), a :class:`~prefixcache.cache.FakeClock` set to each request's ``ts``, and
a :class:`~prefixcache.analysis.costs.CostModel` in place of the model runner (payload ``None``,
``nbytes = block_size * kv_bytes_per_token``). Each tenant gets its own namespace (salted), as
the server does.

Load model: a replica prefills one request at a time (FIFO); a request's estimated TTFT is its
wait for the replica plus its own uncached prefill at ``prefill_tps``. Decode is assumed to be
batched alongside and is not queued.

Routing (:data:`ROUTINGS`): round-robin; random (seeded); least-loaded (smallest prefill backlog);
prefix-affinity (rendezvous hash of the tenant and the first K blocks); cache-aware (the replica
whose cache holds the longest prefix, probed without touching; it moves to the least-loaded
replica when the wait there would cost more than the prefill the hit saves).

Keep-warm: for chosen endpoints a refresh request reading the endpoint's current prefix is
replayed whenever the prefix has been idle for 0.95 x TTL, while the endpoint has traffic left
(one refresh per TTL at most: the cost hosted APIs charge). Each refresh goes through the real
cache, so it is what keeps the blocks alive.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.costs import CostBreakdown, CostModel, TokenTotals, price, pricing_profile
from prefixcache.analysis.feed import TraceFeed, TraceUnsorted, can_stream, stream
from prefixcache.analysis.keychains import KeyChains, paused_gc
from prefixcache.analysis.trace import Trace, load_trace
from prefixcache.cache import FakeClock, Namespace, PrefixCache, model_fingerprint, pack_tokens

log = logging.getLogger(__name__)

ROUTINGS = ("round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware")


@dataclass(slots=True)
class SimConfig:
    ttl_s: float = 300.0
    capacity_bytes: int = 16 << 30  # per replica
    block_size: int = 16
    # Hits end on a multiple of this and only complete chunks are stored, as in the engine (whose
    # default prefill chunk is 512); None: the block size (the cache's own granularity).
    align_tokens: int | None = None
    replicas: int = 1
    routing: str = "round-robin"
    affinity_blocks: int = 4  # K for prefix-affinity
    seed: int = 0
    keep_warm: dict[str, int] = field(default_factory=dict)  # endpoint -> prefix tokens
    cost: CostModel = field(default_factory=CostModel)
    pricing: tuple[str, ...] = ("anthropic", "openai", "self-hosted")
    gpu_hour: float = 2.0
    fingerprint: str = model_fingerprint("sim", "float32", 16)


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
                "ttl_s": c.ttl_s, "capacity_bytes": c.capacity_bytes, "block_size": c.block_size,
                "align_tokens": c.align_tokens or c.block_size, "replicas": c.replicas, "routing": c.routing,
                "keep_warm": c.keep_warm, "prefill_tps": c.cost.prefill_tps, "prefill_tps_source": c.cost.source,
                "kv_bytes_per_token": c.cost.kv_bytes_per_token,
            },
            "requests": len(self.cached),
            "hit_rate": self.hit_rate,
            "prompt_tokens": t.prompt,
            "cached_tokens": t.cached,
            "prefilled_tokens": t.uncached,
            "cache_write_tokens": t.written + t.written_long,
            "output_tokens": t.output,
            "prefill_s": self.prefill_s,
            "ttft_s": _pcts(self.ttft_s),
            "keep_warm_refreshes": self.keep_warm_refreshes,
            "keep_warm_read_tokens": t.keep_warm_reads,
            "endpoints": self.endpoints,
            "replicas": self.replicas,
            "costs": [x.as_dict() for x in self.costs],
        }


def _pcts(a: np.ndarray) -> dict[str, float]:
    if len(a) == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


class _Router:
    """Picks a replica per request. ``choose`` may read the caches but never mutates them."""

    def __init__(self, cfg: SimConfig, caches: list[PrefixCache], busy: list[float]) -> None:
        self.cfg, self.caches, self.busy = cfg, caches, busy
        self.n = len(caches)
        self.rr = 0
        self.rng = np.random.default_rng(cfg.seed)
        self.salts = [r.to_bytes(4, "little") for r in range(self.n)]

    def least_loaded(self, now: float) -> int:
        return min(range(self.n), key=lambda r: (max(self.busy[r] - now, 0.0), r))

    def affinity(self, tokens: np.ndarray, ns: Namespace) -> int:
        head = pack_tokens(tokens[: self.cfg.affinity_blocks * self.cfg.block_size])
        digest = hashlib.blake2b(ns.root + head, digest_size=16).digest()
        scores = [hashlib.blake2b(digest + s, digest_size=8).digest() for s in self.salts]  # rendezvous
        return max(range(self.n), key=scores.__getitem__)

    def cached_blocks(self, r: int, keys: list[bytes], packed: bytes) -> int:
        """Longest live cached prefix on replica r (a walk that touches nothing)."""
        return self.caches[r].cached_prefix(keys, packed)

    def choose(self, tokens: np.ndarray, ns: Namespace, now: float, keys: list[bytes], packed: bytes) -> int:
        if self.n == 1:
            return 0
        policy = self.cfg.routing
        if policy == "round-robin":
            self.rr = (self.rr + 1) % self.n
            return self.rr
        if policy == "random":
            return int(self.rng.integers(self.n))
        if policy == "least-loaded":
            return self.least_loaded(now)
        if policy == "prefix-affinity":
            return self.affinity(tokens, ns)
        # cache-aware: minimise estimated TTFT = wait + uncached prefill; ties -> more cached.
        model = self.cfg.cost
        best, best_score = 0, (float("inf"), 0, 0)
        for r in range(self.n):
            hit = self.cached_blocks(r, keys, packed) * self.cfg.block_size
            score = (max(self.busy[r] - now, 0.0) + model.prefill_s(len(tokens) - hit), -hit, r)
            if score < best_score:
                best, best_score = r, score
        return best


def simulate(trace: Trace | TraceFeed, cfg: SimConfig, *, progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay ``trace`` under ``cfg``. Deterministic for a given trace and config.

    ``trace`` may be a :class:`~prefixcache.analysis.feed.TraceFeed` (a stream from a reader
    process: see :func:`simulate_file`) made with ``cfg.fingerprint`` and ``cfg.block_size``;
    keep-warm needs a loaded trace (it looks ahead to each endpoint's last request).

    Work per request is O(runs on the prompt's path) in the cache, plus C-level copies of its new
    tokens and keys (and, for cache-aware routing, one walk per replica), never O(cache size).
    """
    if cfg.routing not in ROUTINGS:
        raise ValueError(f"unknown routing {cfg.routing!r}; choose one of {', '.join(ROUTINGS)}")
    if isinstance(trace, TraceFeed):
        feed = trace
        if (feed.fingerprint, feed.block_size) != (cfg.fingerprint, cfg.block_size):
            raise ValueError("the feed's keys were made for another fingerprint or block size than the config's")
        if cfg.keep_warm and not feed.complete:
            raise ValueError("keep-warm needs the whole trace loaded (load_trace), not a stream")
    else:
        feed = TraceFeed.of(trace, cfg.fingerprint, cfg.block_size)
    with paused_gc():
        return _simulate(feed, cfg, progress)


def simulate_file(
    path: str | Path, cfg: SimConfig, *, tokenizer: str | None = None,
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
                on = (lambda _i: progress("simulating", feed.position, feed.size)) if progress is not None else None
                try:
                    return simulate(feed, cfg, progress=on)
                except TraceUnsorted as exc:
                    log.info("%s; loading and sorting the whole trace instead", exc)
    trace = load_trace(path, tokenizer=tokenizer,
                       progress=(lambda k: progress("reading", k, 0)) if progress is not None else None)
    n = len(trace)
    return simulate(trace, cfg, progress=(lambda i: progress("simulating", i, n)) if progress is not None else None)


def _simulate(feed: TraceFeed, cfg: SimConfig, progress: Callable[[int], None] | None) -> SimResult:
    B = cfg.block_size
    clock = FakeClock(feed.ts[0] if feed.ts else 0.0)
    caches = [
        PrefixCache(block_size=B, capacity_bytes=cfg.capacity_bytes, default_ttl_s=cfg.ttl_s, clock=clock,
                    pinned_capacity_bytes=0)
        for _ in range(max(1, cfg.replicas))
    ]
    busy = [0.0] * len(caches)
    router = _Router(cfg, caches, busy)
    namespaces: list[Namespace] = []  # by tenant id, made as tenants appear
    block_bytes = cfg.cost.block_bytes(B)
    # Keys come from the feed: fingerprints (see keychains.py), which never leave this process;
    # every hit is still verified token by token.

    align = cfg.align_tokens or B
    tps = cfg.cost.prefill_tps
    totals = TokenTotals()

    # Keep-warm (a loaded trace): endpoint code -> prefix tokens; refreshes come due on a heap.
    warm = {feed.endpoints.index(e): p for e, p in cfg.keep_warm.items() if e in feed.endpoints}
    last_ts = _last_ts(feed.trace()) if warm else {}
    chains = KeyChains(feed.segments, B, hasher="fingerprint") if warm else None  # refreshes' prefixes
    current_prefix: dict[int, tuple[np.ndarray, Namespace]] = {}
    due: list[tuple[float, int]] = []
    next_due: dict[int, float] = {}
    refreshes = 0
    warm_period = 0.95 * cfg.ttl_s

    def refresh(ep: int, at: float) -> None:
        nonlocal refreshes
        clock.set(max(at, clock.now))
        toks, ns = current_prefix[ep]
        targets = [router.affinity(toks, ns)] if cfg.routing == "prefix-affinity" and len(caches) > 1 else range(len(caches))
        keys = chains.token_keys(ns.root, toks)  # type: ignore[union-attr]
        packed = pack_tokens(toks)
        for r in targets:
            hit, _ = caches[r].replay(ns, keys, packed, nbytes=block_bytes, align_tokens=align)
            totals.keep_warm_reads += hit
            refreshes += 1

    ts_col = feed.ts
    tenant_col = feed.tenant
    endpoint_col = feed.endpoint
    ttl_list = feed.ttl_s
    parts = feed.parts
    segments = feed.segments

    long_segs: dict[int, bytes] = {}

    def seg_bytes(j: int) -> bytes:
        """A segment as packed bytes; long ones (shared system prompts) are kept."""
        b = long_segs.get(j)
        if b is None:
            b = segments[j].tobytes()
            if len(b) >= 1024:
                if len(long_segs) >= 4096:
                    long_segs.clear()
                long_segs[j] = b
        return b

    packed_of = feed.seg_bytes.__getitem__ if feed.seg_bytes is not None else None  # streams: segments packed
    n_rep = len(caches)
    cached_l: list[int] = []
    written_l: list[int] = []
    replica_l: list[int] = []
    ttft_l: list[float] = []
    written_short = written_long = 0
    default_long = cfg.ttl_s >= 3600
    for i, keys in enumerate(feed):
        t = ts_col[i]
        while due and due[0][0] <= t:
            at, ep = heapq.heappop(due)
            if next_due.get(ep) != at:
                continue  # superseded by real traffic
            refresh(ep, at)
            if at + warm_period < last_ts[ep]:
                next_due[ep] = at + warm_period
                heapq.heappush(due, (at + warm_period, ep))
        if t > clock.now:
            clock.set(t)
        p = parts[i]
        if len(p) == 1:
            tokens = segments[p[0]]
            packed = packed_of(p[0]) if packed_of is not None else tokens.tobytes()
        else:
            packed = b"".join(map(packed_of or seg_bytes, p))
            tokens = None
        n_tok = len(packed) >> 2
        try:
            ns = namespaces[tenant_col[i]]
        except IndexError:
            namespaces.extend(Namespace.create(cfg.fingerprint, tenant=name, salt=f"tenant:{name}")
                              for name in feed.tenants[len(namespaces):])
            ns = namespaces[tenant_col[i]]
        if n_rep > 1:
            if tokens is None:
                tokens = np.frombuffer(packed, dtype=np.uint32)
            r = router.choose(tokens, ns, t, keys, packed)
        else:
            r = 0
        cache = caches[r]
        ttl = ttl_list[i]
        if ttl != ttl:  # NaN: the default
            ttl = None
        # match + commit + release in one call. As the engine does, only blocks of complete prefill
        # chunks are committed (a block of the last, partial chunk would not be bitwise what a
        # longer prompt computes).
        hit, w = cache.replay(ns, keys, packed, nbytes=block_bytes, ttl_s=ttl, align_tokens=align,
                              upto_tokens=(n_tok // align) * align if align > B else None)
        cached_l.append(hit)
        written_l.append(w)
        if (ttl >= 3600) if ttl is not None else default_long:  # the 1 h write class (priced 2x by anthropic)
            written_long += w
        else:
            written_short += w
        replica_l.append(r)
        b = busy[r]
        start = t if t > b else b
        work = (n_tok - hit) / tps
        busy[r] = start + work
        ttft_l.append(start - t + work)
        if warm:
            ep = endpoint_col[i]
            if ep in warm:
                if tokens is None:
                    tokens = np.frombuffer(packed, dtype=np.uint32)
                q = min(warm[ep] + 1, n_tok)  # +1: a match always leaves one token to compute
                current_prefix[ep] = (tokens[:q], ns)
                if t + warm_period < last_ts[ep]:
                    next_due[ep] = t + warm_period
                    heapq.heappush(due, (t + warm_period, ep))
        if progress is not None and i % 5000 == 0:
            progress(i)
    trace = feed.trace()
    totals.prompt = int(trace.prompt_tokens.sum())
    totals.output = int(trace.output_tokens.sum())
    cached = np.asarray(cached_l, dtype=np.int64)
    written = np.asarray(written_l, dtype=np.int64)
    replica = np.asarray(replica_l, dtype=np.int16)
    ttft = np.asarray(ttft_l, dtype=np.float64)
    totals.written += written_short
    totals.written_long += written_long
    totals.cached = int(cached.sum())
    endpoints = _per_endpoint(trace, cached, ttft)
    reps = []
    for r, c in enumerate(caches):
        mask = replica == r
        st = c.stats()
        q = int(trace.prompt_tokens[mask].sum())
        reps.append({
            "replica": r, "requests": int(mask.sum()),
            "hit_rate": float(cached[mask].sum() / q) if q else 0.0,
            "blocks": st.blocks, "bytes": st.bytes, "evictions": st.evictions,
        })
    model = cfg.cost
    costs = [price(totals, pricing_profile(p, gpu_hour=cfg.gpu_hour), model) for p in cfg.pricing]
    return SimResult(cfg, totals, cached, written, replica, ttft, endpoints, reps, refreshes, costs)


def _last_ts(trace: Trace) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in range(len(trace.endpoints)):
        idx = np.flatnonzero(trace.endpoint == e)
        if len(idx):
            out[e] = float(trace.ts[idx[-1]])
    return out


def _per_endpoint(trace: Trace, cached: np.ndarray, ttft: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for e, name in enumerate(trace.endpoints):
        mask = trace.endpoint == e
        q = int(trace.prompt_tokens[mask].sum())
        rows.append({
            "endpoint": name, "requests": int(mask.sum()), "prompt_tokens": q,
            "cached_tokens": int(cached[mask].sum()),
            "hit_rate": float(cached[mask].sum() / q) if q else 0.0,
            "ttft_s": _pcts(ttft[mask]),
        })
    return rows


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``ttl=60,300,900`` -> ("ttl", ["60", "300", "900"]); also capacity=, replicas=, block_size=."""
    name, _, vals = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in ("ttl", "capacity", "replicas", "block_size") or not vals:
        raise ValueError(f"--sweep {text!r}: use ttl=60,300,... or capacity=1GiB,4GiB,... (or replicas=, block_size=)")
    return name, [v.strip() for v in vals.split(",") if v.strip()]


def sweep(
    trace: Trace, base: SimConfig, name: str, values: list[Any], *, progress: Callable[[int], None] | None = None
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
