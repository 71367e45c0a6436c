"""Replica state and routing policies.

A policy orders the healthy replicas by preference for one request; the proxy tries them in
that order (the second is the fail-over target). Policies share one load guard: when the
preferred replica's in-flight count runs far above the least-loaded one
(``in_flight > load_factor * min + load_slack``) the least-loaded replica goes first instead,
since queueing behind a hot replica costs more than one prefill.

* ``round-robin``: rotate from the first replica; ignores prefixes (the baseline).
* ``random``: a seeded draw (``random.Random(seed)``), the rest in order after it.
* ``least-loaded``: fewest in-flight requests, ties broken by fewest routed.
* ``prefix-affinity``: rendezvous hashing of the affinity key (a fixed leading part of the
  prompt, or ``prompt_cache_key``) over the healthy replicas: stable, stateless, and when a
  replica dies only its keys move.
* ``cache-aware``: an approximate record of which replica holds which prefix (chained chunk
  hashes -> replica, LRU-bounded, forgotten after ``ttl_s`` like the replicas' own TTL); the
  replica holding the longest recorded prefix wins; with no record, rendezvous hashing as above.
  The record is updated with every routed request (the replica that computes a prefix holds
  it afterwards) and drops a replica's chunks when a request to it fails to connect. With the
  replicas' KV events (``route --kv-events``), a precise view of what each replica holds
  overrides the record, and a prefix nobody holds goes least-loaded (see
  :mod:`~prefixcache.router.kv_index`).
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from prefixcache.cache.config import DEFAULTS
from prefixcache.router.affinity import PrefixKey
from prefixcache.router.kv_index import KVIndex
from prefixcache.routing import random_pick, rendezvous_order


class Policy(StrEnum):
    PREFIX_AFFINITY = "prefix-affinity"
    CACHE_AWARE = "cache-aware"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


@dataclass(slots=True)
class Replica:
    """One upstream server and what the router counts about it."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0  # requests sent here (attempts included)
    completed: int = 0
    failed: int = 0  # upstream errors after which nothing could be retried
    connect_failures: int = 0  # requests lost to a refused, reset or closed connection (marked down)
    timeouts: int = 0  # requests the replica was too slow for (read timeout; not marked down)
    broken_streams: int = 0  # streams cut after bytes went to the client
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_error: str = ""
    consecutive_health_failures: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def rendezvous(key: str, replicas: Sequence[Replica]) -> list[Replica]:
    """Highest-random-weight order of ``replicas`` for ``key`` (stable across processes;
    :func:`prefixcache.routing.rendezvous_order` over their URLs)."""
    return [replicas[i] for i in rendezvous_order(key, [r.url for r in replicas])]


@dataclass(slots=True)
class PrefixRecord:
    """Approximate map chunk hash -> (replica url, last seen), bounded and time-limited."""

    max_entries: int = 200_000
    ttl_s: float = DEFAULTS.default_ttl_s
    clock: Callable[[], float] = time.monotonic
    # In last-recorded order (record moves an entry to the end with the time now), so the
    # expired entries are the front ones.
    _map: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)
    _held: Counter[str] = field(default_factory=Counter)  # replica url -> entries of _map

    def longest(self, chunks: Sequence[str], alive: set[str]) -> tuple[str | None, int]:
        """The replica holding the longest recorded prefix of ``chunks`` among ``alive`` and its
        length in chunks (``None, 0`` when nothing is recorded)."""
        now = self.clock()
        best: tuple[str | None, int] = (None, 0)
        for i, h in enumerate(chunks):
            entry = self._map.get(h)
            if entry is None or now - entry[1] > self.ttl_s:
                break
            if entry[0] in alive:
                best = (entry[0], i + 1)
        return best

    def entry(self, chunk: str) -> tuple[str, float] | None:
        """(replica url, when recorded) of one chunk hash, None if unknown or forgotten."""
        entry = self._map.get(chunk)
        if entry is None or self.clock() - entry[1] > self.ttl_s:
            return None
        return entry

    def record(self, chunks: Sequence[str], url: str) -> None:
        now = self.clock()
        for h in chunks:
            old = self._map.get(h)
            if old is not None:
                self._held[old[0]] -= 1
            self._map[h] = (url, now)
            self._map.move_to_end(h)
            self._held[url] += 1
        while len(self._map) > self.max_entries:
            self._held[self._map.popitem(last=False)[1][0]] -= 1

    def forget(self, chunks: Sequence[str], url: str) -> None:
        for h in chunks:
            entry = self._map.get(h)
            if entry is not None and entry[0] == url:
                del self._map[h]
                self._held[url] -= 1

    def held_by(self) -> dict[str, int]:
        """Live (unexpired) entries per replica url: where the recorded prefixes live. Drops the
        expired entries first (they are at the front), so it costs O(replicas + expired)."""
        now = self.clock()
        while self._map:
            url, seen = next(iter(self._map.values()))
            if now - seen <= self.ttl_s:
                break
            self._map.popitem(last=False)
            self._held[url] -= 1
        return {url: n for url, n in self._held.items() if n > 0}

    def __len__(self) -> int:
        return len(self._map)


class Router:
    """Chooses replicas. Thread-safe (one lock; every call is O(replicas + chunks))."""

    def __init__(
        self,
        urls: Sequence[str],
        policy: Policy | str = Policy.CACHE_AWARE,
        *,
        load_factor: float = 2.0,
        load_slack: int = 4,
        record_ttl_s: float = DEFAULTS.default_ttl_s,
        clock: Callable[[], float] = time.monotonic,
        kv_index: KVIndex | None = None,
        seed: int = 0,
    ) -> None:
        if not urls:
            raise ValueError("the router needs at least one --replica URL")
        self.policy = Policy(policy)
        self.replicas = [Replica(url=u.rstrip("/")) for u in urls]
        self.load_factor = load_factor
        self.load_slack = load_slack
        self.record = PrefixRecord(ttl_s=record_ttl_s, clock=clock)
        self.kv_index = kv_index  # replicas' KV events (cache-aware only), or None
        self._rr = itertools.count()
        self._rng = random.Random(seed)  # the random policy's draws
        self._lock = threading.Lock()
        self.load_fallbacks = 0
        self.failovers = 0

    def by_url(self, url: str) -> Replica | None:
        return next((r for r in self.replicas if r.url == url), None)

    def candidates(self, key: PrefixKey) -> list[Replica]:
        """Healthy replicas in order of preference for this request (all replicas, in the same
        order, if none is healthy: a health check may lag behind a recovery)."""
        with self._lock:
            alive = [r for r in self.replicas if r.healthy] or list(self.replicas)
            order = self._order(key, alive)
            least = min(alive, key=lambda r: (r.in_flight, r.routed))
            first = order[0]
            if first is not least and first.in_flight > self.load_factor * least.in_flight + self.load_slack:
                self.load_fallbacks += 1
                order.remove(least)
                order.insert(0, least)
            return order

    def _order(self, key: PrefixKey, alive: list[Replica]) -> list[Replica]:
        if self.policy is Policy.ROUND_ROBIN:
            start = next(self._rr) % len(alive)
            return alive[start:] + alive[:start]
        if self.policy is Policy.RANDOM:
            pick = alive[random_pick(self._rng, len(alive))]
            return [pick, *(r for r in alive if r is not pick)]
        if self.policy is Policy.LEAST_LOADED:
            return sorted(alive, key=lambda r: (r.in_flight, r.routed))
        hashed = rendezvous(key.affinity, alive)
        if self.policy is Policy.PREFIX_AFFINITY or key.explicit:
            return hashed
        if self.kv_index is not None and self.kv_index.publishes([r.url for r in alive]):
            return self._order_by_events(key, alive, hashed)
        url, depth = self.record.longest(key.chunks, {r.url for r in alive})
        if url is None or depth == 0:
            return hashed
        holder = next(r for r in alive if r.url == url)
        return [holder, *(r for r in hashed if r is not holder)]

    def _order_by_events(self, key: PrefixKey, alive: list[Replica], hashed: list[Replica]) -> list[Replica]:
        """The replica holding the deepest prefix by the KV events (the record where a replica
        publishes nothing: :mod:`~prefixcache.router.kv_index`) first; with none holding any,
        the least-loaded first."""
        assert self.kv_index is not None
        depths = {r.url: self.kv_index.depth(r.url, key.chunks, self.record.entry) for r in alive}
        best = max(depths.values())
        if best == 0:
            return sorted(alive, key=lambda r: (r.in_flight, r.routed))
        holder = next(r for r in hashed if depths[r.url] == best)
        return [holder, *(r for r in hashed if r is not holder)]

    # ------------------------------------------------------------------ bookkeeping
    def started(self, replica: Replica, key: PrefixKey) -> None:
        with self._lock:
            replica.in_flight += 1
            replica.routed += 1
            if self.policy is Policy.CACHE_AWARE:
                self.record.record(key.chunks, replica.url)

    def finished(self, replica: Replica, *, ok: bool, error: str = "") -> None:
        with self._lock:
            replica.in_flight = max(0, replica.in_flight - 1)
            if ok:
                replica.completed += 1
            else:
                replica.failed += 1
                replica.last_error = error[:300]

    def connect_failed(self, replica: Replica, key: PrefixKey, error: str) -> None:
        """A request was lost at ``replica``'s connection (refused, reset, closed before the answer
        was complete): mark it down until a health check passes, and forget its prefixes."""
        with self._lock:
            replica.in_flight = max(0, replica.in_flight - 1)
            replica.connect_failures += 1
            replica.healthy = False
            replica.last_error = error[:300]
            self.record.forget(key.chunks, replica.url)

    def failed_over(self) -> None:
        """A request is being retried on another replica (at most once per request)."""
        with self._lock:
            self.failovers += 1

    def timed_out(self, replica: Replica, error: str) -> None:
        """``replica`` sent nothing within the read timeout: a failed request, but the replica
        stays in rotation (slow is not down; the health check judges liveness)."""
        with self._lock:
            replica.in_flight = max(0, replica.in_flight - 1)
            replica.failed += 1
            replica.timeouts += 1
            replica.last_error = error[:300]

    def stream_broken(self, replica: Replica, error: str, *, down: bool) -> None:
        """A stream from ``replica`` broke after bytes went to the client (not retried). ``down``:
        the connection was lost (marked down); a read timeout leaves the replica up."""
        with self._lock:
            replica.in_flight = max(0, replica.in_flight - 1)
            replica.failed += 1
            replica.broken_streams += 1
            replica.last_error = error[:300]
            if down:
                replica.healthy = False
            else:
                replica.timeouts += 1

    def usage(self, replica: Replica, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            replica.prompt_tokens += prompt_tokens
            replica.cached_tokens += cached_tokens

    def set_health(self, replica: Replica, healthy: bool, error: str = "") -> None:
        with self._lock:
            if healthy:
                replica.consecutive_health_failures = 0
            else:
                replica.consecutive_health_failures += 1
                replica.last_error = error[:300] or replica.last_error
            replica.healthy = healthy

    def prefixes_by_replica(self) -> dict[str, int]:
        """Recorded prefix chunks per replica url (the cache-aware policy's record; empty under
        the other policies, which keep none)."""
        with self._lock:
            return self.record.held_by()

    def snapshot(self) -> list[dict[str, object]]:
        with self._lock:
            return [
                {
                    "url": r.url,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "routed": r.routed,
                    "completed": r.completed,
                    "failed": r.failed,
                    "connect_failures": r.connect_failures,
                    "timeouts": r.timeouts,
                    "broken_streams": r.broken_streams,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "hit_rate": round(r.hit_rate, 4),
                    "last_error": r.last_error,
                }
                for r in self.replicas
            ]
