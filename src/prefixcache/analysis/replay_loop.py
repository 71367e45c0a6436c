"""The simulator's replay: every request of a trace through the replicas' real PrefixCaches.

:func:`replay_requests` runs the loop :func:`~prefixcache.analysis.simulate.simulate` describes
(its module docstring has the load model, the routings and keep-warm) and returns the raw
outcome: per-request columns, the token totals and the caches. Turning that into a
:class:`~prefixcache.analysis.simulate.SimResult` (per endpoint, per replica, priced) is the
caller's.

Parts: :class:`_Replicas` (the caches on one clock, their prefill queues, the namespaces),
:class:`SimRouter` (picks a replica; reads the caches, never mutates them), :class:`_KeepWarm`
(the router's pin rounds) and :class:`_Prompts` (a request's tokens as packed bytes). Each
request costs O(runs on the prompt's path) in its cache, plus C-level copies of its new tokens
and keys (and, for cache-aware routing, one walk per replica), never O(cache size).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from prefixcache.analysis.config import SimConfig
from prefixcache.analysis.costs import LONG_TTL_S, TokenTotals
from prefixcache.analysis.feed import TraceFeed
from prefixcache.analysis.trace.keychains import KeyChains
from prefixcache.cache import FakeClock, Namespace, PinBudgetExceeded, PrefixCache, pack_tokens
from prefixcache.routing import affinity_index, chain_root, chunk_chain, random_pick, rendezvous_order

log = logging.getLogger(__name__)

_LONG_SEGMENT_BYTES = 1024  # a loaded trace's segments this long (shared system prompts) stay packed
_MAX_KEPT_SEGMENTS = 4096  # packed segments kept, before the memo starts over


@dataclass(slots=True)
class ReplayOutcome:
    """What the replay measured; columns are per request, in feed order."""

    cached: np.ndarray  # int64: tokens read from the cache
    written: np.ndarray  # int64: tokens written to it
    replica: np.ndarray  # int16: where the request went
    ttft_s: np.ndarray  # float64, estimated: wait for the replica + own uncached prefill
    totals: TokenTotals  # written, written_long and keep_warm_reads filled in (not prompt/output/cached)
    caches: list[PrefixCache]  # one per replica, as the replay left them
    keep_warm_refreshes: int


def replay_requests(
    feed: TraceFeed, cfg: SimConfig, progress: Callable[[int], None] | None = None
) -> ReplayOutcome:
    """Replay ``feed`` (keys made with ``cfg.fingerprint`` and ``cfg.block_size``; a loaded trace
    when ``cfg.keep_warm``) under ``cfg``. Deterministic. ``progress(i)`` every 5,000 requests."""
    return _Replay(feed, cfg).run(progress)


class _Replay:
    """One replay: the replicas, the router, keep-warm and the result columns."""

    def __init__(self, feed: TraceFeed, cfg: SimConfig) -> None:
        self.feed = feed
        self.cfg = cfg
        self.replicas = _Replicas(feed, cfg)
        self.router = SimRouter(cfg, self.replicas)
        self.prompts = _Prompts(feed)
        warm = {feed.endpoints.index(e): p for e, p in cfg.keep_warm.items() if e in feed.endpoints}
        self.keep_warm = _KeepWarm(feed, cfg, warm, self.replicas) if warm else None
        self.cached: list[int] = []
        self.written: list[int] = []
        self.replica: list[int] = []
        self.ttft_s: list[float] = []

    def run(self, progress: Callable[[int], None] | None) -> ReplayOutcome:
        """Every request of the feed, in order; then the outcome (see :meth:`_outcome`)."""
        feed, replicas, keep_warm = self.feed, self.replicas, self.keep_warm
        ts, tenant_of, ttl_of = feed.ts, feed.tenant, feed.ttl_s
        clock, caches, namespaces = replicas.clock, replicas.caches, replicas.namespaces
        queue_prefill = replicas.queue_prefill
        add_cached, add_written = self.cached.append, self.written.append
        add_replica, add_ttft = self.replica.append, self.ttft_s.append
        prompt = self.prompts.prompt
        choose = self.router.choose if len(caches) > 1 else None
        block_bytes, align = replicas.block_bytes, replicas.align
        whole_chunks = align > self.cfg.block_size  # commit only blocks of complete prefill chunks
        for i, keys in enumerate(feed):
            now = ts[i]
            if keep_warm is not None:
                keep_warm.refresh_due(now)
            if now > clock.now:
                clock.set(now)
            packed, tokens = prompt(i)
            n_tokens = len(packed) >> 2
            ns = namespaces[tenant_of[i]]
            replica = choose(tokens, ns, now, keys, packed) if choose is not None else 0
            ttl = ttl_of[i]
            if ttl != ttl:  # NaN: the cache's default
                ttl = None
            # match + commit + release in one call. As the engine does, only blocks of complete
            # prefill chunks are committed (a block of the last, partial chunk would not be
            # bitwise what a longer prompt computes).
            hit, written = caches[replica].replay(
                ns,
                keys,
                packed,
                nbytes=block_bytes,
                ttl_s=ttl,
                align_tokens=align,
                upto_tokens=(n_tokens // align) * align if whole_chunks else None,
            )
            add_cached(hit)
            add_written(written)
            add_replica(replica)
            add_ttft(queue_prefill(replica, now, n_tokens - hit))
            if progress is not None and i % 5000 == 0:
                progress(i)
        return self._outcome()

    def _outcome(self) -> ReplayOutcome:
        """The columns as arrays; written tokens split by TTL class (a request without its own TTL
        gets the cache's default)."""
        written = np.asarray(self.written, dtype=np.int64)
        ttl = np.asarray(self.feed.ttl_s[: len(written)], dtype=np.float64)
        long_class = np.where(np.isnan(ttl), self.replicas.default_ttl_is_long, ttl >= LONG_TTL_S)
        totals = TokenTotals(
            written=int(written[~long_class].sum()), written_long=int(written[long_class].sum())
        )
        refreshes = 0
        if self.keep_warm is not None:
            totals.keep_warm_reads = self.keep_warm.reads
            refreshes = self.keep_warm.refreshes
        return ReplayOutcome(
            cached=np.asarray(self.cached, dtype=np.int64),
            written=written,
            replica=np.asarray(self.replica, dtype=np.int16),
            ttft_s=np.asarray(self.ttft_s, dtype=np.float64),
            totals=totals,
            caches=self.replicas.caches,
            keep_warm_refreshes=refreshes,
        )


class _Replicas:
    """The replicas' caches on one simulated clock, when each one's prefill queue empties
    (``busy``, seconds on that clock), and each tenant's namespace (salted as the server does)."""

    def __init__(self, feed: TraceFeed, cfg: SimConfig) -> None:
        self.clock = FakeClock(feed.ts[0] if feed.ts else 0.0)
        self.caches = [
            PrefixCache(
                block_size=cfg.block_size,
                capacity_bytes=cfg.capacity_bytes,
                default_ttl_s=cfg.ttl_s,
                clock=self.clock,
                pinned_capacity_bytes=cfg.pinned_capacity_bytes if cfg.keep_warm else 0,
            )
            for _ in range(max(1, cfg.replicas))
        ]
        self.busy = [0.0] * len(self.caches)
        self.block_bytes = cfg.cost.block_bytes(cfg.block_size)  # every block's size in the cache
        self.align = cfg.align_tokens or cfg.block_size
        self.prefill_tps = cfg.cost.prefill_tps
        self.default_ttl_is_long = cfg.ttl_s >= LONG_TTL_S
        self.namespaces = _Namespaces(cfg.fingerprint, feed)

    def queue_prefill(self, replica: int, now: float, tokens: int) -> float:
        """Queue ``tokens`` of prefill at ``replica`` (FIFO, one request at a time) at ``now``;
        returns the request's estimated TTFT: its wait plus its own prefill."""
        busy = self.busy
        start = now if now > busy[replica] else busy[replica]
        work = tokens / self.prefill_tps
        busy[replica] = start + work
        return start - now + work


class _Namespaces(dict[int, Namespace]):
    """Tenant id -> the tenant's namespace (salted as the server does), made on first use, so
    that a request's lookup is one plain dict lookup."""

    def __init__(self, fingerprint: str, feed: TraceFeed) -> None:
        super().__init__()
        self.fingerprint = fingerprint
        self.feed = feed  # (whose tenant names grow as a stream is read)

    def __missing__(self, tenant: int) -> Namespace:
        name = self.feed.tenants[tenant]
        namespace = self[tenant] = Namespace.create(self.fingerprint, tenant=name, salt=f"tenant:{name}")
        return namespace


class _Prompts:
    """A request's prompt as packed bytes (what the cache compares) and, when it is one segment,
    as that segment's token array (else None: callers that need tokens unpack the bytes)."""

    def __init__(self, feed: TraceFeed) -> None:
        self.parts = feed.parts
        self.segments = feed.segments
        self.stream_packed = feed.seg_bytes  # streams send every segment packed already
        self.packed_segment = self.stream_packed.__getitem__ if self.stream_packed is not None else self._pack
        self.kept: dict[int, bytes] = {}  # a loaded trace's long segments, packed

    def prompt(self, i: int) -> tuple[bytes, np.ndarray | None]:
        """Request ``i``'s (packed prompt, token array or None)."""
        parts = self.parts[i]
        if len(parts) == 1:
            tokens = self.segments[parts[0]]
            stream_packed = self.stream_packed
            return (stream_packed[parts[0]] if stream_packed is not None else tokens.tobytes()), tokens
        return b"".join(map(self.packed_segment, parts)), None

    def _pack(self, segment: int) -> bytes:
        """A loaded trace's segment, packed (called per segment of every prompt: kept lean)."""
        kept = self.kept
        packed = kept.get(segment)
        if packed is None:
            packed = self.segments[segment].tobytes()
            if len(packed) >= _LONG_SEGMENT_BYTES:
                if len(kept) >= _MAX_KEPT_SEGMENTS:
                    kept.clear()
                kept[segment] = packed
        return packed


def _unpacked(packed: bytes) -> np.ndarray:
    return np.frombuffer(packed, dtype=np.uint32)


class SimRouter:
    """Picks a replica per request (:data:`~prefixcache.analysis.config.ROUTINGS`), as the router
    that ships does where it can (:mod:`prefixcache.routing`): round-robin from replica 0, the
    same seeded draw for random, the router's rendezvous hashing of the router's chained prefix
    key for prefix-affinity (over token blocks: a trace has no text). Least-loaded and cache-aware
    are the simulator's own (the load model has no in-flight count; cache-aware reads the caches).
    :meth:`choose` may read the caches but never mutates them."""

    def __init__(self, cfg: SimConfig, replicas: _Replicas) -> None:
        self.policy = cfg.routing
        self.affinity_blocks = cfg.affinity_blocks
        self.block_size = cfg.block_size
        self.cost = cfg.cost
        self.caches = replicas.caches
        self.busy = replicas.busy
        self.count = len(self.caches)
        self.routed = 0  # round-robin's position
        self.rng = random.Random(cfg.seed)
        self.names = replica_names(self.count)
        self.roots: dict[str, bytes] = {}  # tenant -> chain root
        self.placed: dict[tuple[str, bytes], int] = {}  # (tenant, leading blocks) -> replica

    def choose(
        self, tokens: np.ndarray | None, ns: Namespace, now: float, keys: list[bytes], packed: bytes
    ) -> int:
        """The replica for a request (``tokens`` None: unpacked from ``packed`` when needed)."""
        if self.count == 1:
            return 0
        policy = self.policy
        if policy == "round-robin":
            self.routed += 1
            return (self.routed - 1) % self.count
        if policy == "random":
            return random_pick(self.rng, self.count)
        if policy == "least-loaded":
            return self.least_loaded(now)
        if tokens is None:
            tokens = _unpacked(packed)
        if policy == "prefix-affinity":
            return self.affinity(tokens, ns)
        # cache-aware: minimise estimated TTFT = wait + uncached prefill; ties -> more cached.
        best, best_score = 0, (float("inf"), 0, 0)
        for r in range(self.count):
            hit = self.caches[r].cached_prefix(keys, packed) * self.block_size  # touches nothing
            score = (max(self.busy[r] - now, 0.0) + self.cost.prefill_s(len(tokens) - hit), -hit, r)
            if score < best_score:
                best, best_score = r, score
        return best

    def least_loaded(self, now: float) -> int:
        return min(range(self.count), key=lambda r: (max(self.busy[r] - now, 0.0), r))

    def affinity(self, tokens: np.ndarray, ns: Namespace) -> int:
        """The router's prefix-affinity choice: rendezvous hashing of the affinity key, the chained
        hash of the first ``affinity_blocks`` blocks from the tenant's root."""
        head = pack_tokens(tokens[: self.affinity_blocks * self.block_size])
        placed = self.placed.get((ns.tenant, head))
        if placed is not None:  # most requests share a leading part (a system prompt)
            return placed
        root = self.roots.get(ns.tenant)
        if root is None:
            root = self.roots[ns.tenant] = chain_root(ns.tenant)
        key = affinity_key(tokens, root, self.block_size, self.affinity_blocks)
        if len(self.placed) >= _MAX_PLACED:
            self.placed.clear()
        placed = self.placed[(ns.tenant, head)] = rendezvous_order(key, self.names)[0]
        return placed


_MAX_PLACED = 1 << 16  # remembered prefix-affinity placements, before the memo starts over


def replica_names(count: int) -> list[str]:
    """The simulated replicas' names, which rendezvous hashing weighs (as the router weighs URLs)."""
    return [f"replica-{r}" for r in range(count)]


def affinity_key(tokens: np.ndarray, root: bytes, block_size: int, affinity_blocks: int) -> str:
    """The prefix-affinity key of a prompt: :func:`prefixcache.routing.chunk_chain` over its full
    blocks (at least one piece, as the router cuts text), at depth ``affinity_blocks``."""
    n = min(max(len(tokens) // block_size, 1), max(1, affinity_blocks))
    pieces = (pack_tokens(tokens[i * block_size : (i + 1) * block_size]) for i in range(n))
    chunks = chunk_chain(root, pieces)
    return chunks[affinity_index(len(chunks), affinity_blocks)]


class _KeepWarm:
    """The router's keep-warm (:mod:`prefixcache.router.keepwarm`) over the replicas: a policy of
    prefixes, one per chosen endpoint (the leading tokens of the endpoint's first request, in its
    tenant's namespace: a loaded trace looks ahead), and a round every ``keep_warm_interval_s``
    from the trace's start. Each round sends every prefix to every replica whatever the routing,
    as ``POST /v1/cache/pin`` does there: the prefix is prefilled through the real cache (a read
    where it is stored, a write where it is not) and then pinned. Pinned blocks neither expire nor
    are evicted and are charged to the separate pinned budget; a pin beyond that budget is refused
    (the server's 409) and logged, and that prefix is cached as any other."""

    def __init__(
        self, feed: TraceFeed, cfg: SimConfig, prefix_tokens: dict[int, int], replicas: _Replicas
    ) -> None:
        self.replicas = replicas
        self.interval = cfg.keep_warm_interval_s
        if not self.interval > 0:
            raise ValueError(f"keep_warm_interval_s must be > 0; got {self.interval}")
        self.whole_chunks = replicas.align > cfg.block_size
        # (endpoint, prefix tokens, their keys in the feed's scheme, namespace)
        self.policy: list[tuple[str, np.ndarray, list[bytes], Namespace]] = []
        chains = KeyChains(feed.segments, cfg.block_size, hasher="fingerprint")
        trace = feed.trace()
        prompts = _Prompts(feed)
        for endpoint, keep in sorted(prefix_tokens.items()):
            first = np.flatnonzero(trace.endpoint == endpoint)
            if not len(first) or keep <= 0:
                continue
            i = int(first[0])
            packed, tokens = prompts.prompt(i)
            if tokens is None:
                tokens = _unpacked(packed)
            ns = replicas.namespaces[int(trace.tenant[i])]
            prefix = np.array(tokens[:keep], dtype=np.uint32)
            self.policy.append((trace.endpoints[endpoint], prefix, chains.token_keys(ns.root, prefix), ns))
        self.next_round = float(trace.ts[0]) if len(trace.ts) else 0.0
        self.refused: set[tuple[int, str]] = set()  # (replica, endpoint) pins refused, logged once
        self.refreshes = 0  # pin requests sent (one per prefix, replica and round)
        self.reads = 0  # tokens the pin requests read from the caches

    def refresh_due(self, now: float) -> None:
        """Run every round due at or before ``now``, in time order, each on the clock at its time."""
        while self.next_round <= now:
            self._round(self.next_round)
            self.next_round += self.interval

    def _round(self, at: float) -> None:
        clock = self.replicas.clock
        if at > clock.now:
            clock.set(at)
        replicas = self.replicas
        align = replicas.align
        for name, tokens, keys, ns in self.policy:
            packed = pack_tokens(tokens)
            n = len(tokens)
            for r, cache in enumerate(replicas.caches):
                hit, _ = cache.replay(
                    ns,
                    keys,
                    packed,
                    nbytes=replicas.block_bytes,
                    align_tokens=align,
                    upto_tokens=(n // align) * align if self.whole_chunks else None,
                )
                self.reads += hit
                self.refreshes += 1
                try:
                    cache.pin(tokens, ns, keys=keys)
                except PinBudgetExceeded as e:
                    if (r, name) not in self.refused:
                        self.refused.add((r, name))
                        log.warning("keep-warm: pinning %r on replica %d refused: %s", name, r, e)
