"""Tiers below the in-memory store: a local disk directory and a shared Redis.

Both speak :class:`~prefixcache.cache.tiers.base.Tier`: the same chained keys as memory, entries
authenticated on read (a MAC keyed from the server's salt secret, the model's block layout, key,
parent, token ids), promoted into memory on a hit, written through on commit (or demoted on
capacity eviction): see :class:`~.stack.TierStack`, which the cache drives. Typical use, by the
server::

    from prefixcache.cache.tiers import attach_tiers
    tiers = attach_tiers(engine.cache, secret=salt_secret, disk_dir="/var/cache/prefixcache",
                         redis_url="redis://host:6379/0")

Lookups go memory -> disk -> Redis; a run found partly on disk continues in Redis.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixcache.cache.tiers.base import BackgroundWriter, Tier, TierStats
from prefixcache.cache.tiers.codec import BlockLayout, CorruptEntry, Entry, TensorCodec, derive_tier_key
from prefixcache.cache.tiers.disk import DEFAULT_DISK_BYTES, DiskTier
from prefixcache.cache.tiers.redis import DEFAULT_MAX_TTL_S, CircuitBreaker, RedisTier, redacted_url
from prefixcache.cache.tiers.stack import TierStack

if TYPE_CHECKING:
    from prefixcache.cache.manager import PrefixCache

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_DISK_BYTES",
    "DEFAULT_MAX_TTL_S",
    "BackgroundWriter",
    "BlockLayout",
    "CircuitBreaker",
    "CorruptEntry",
    "DiskTier",
    "Entry",
    "RedisTier",
    "TensorCodec",
    "Tier",
    "TierStack",
    "TierStats",
    "attach_tiers",
    "derive_tier_key",
    "redacted_url",
    "flush_tiers",
    "tier_stats",
    "refresh_pinned",
    "register_prometheus",
    "start_pin_refresher",
]


def attach_tiers(
    cache: PrefixCache,
    codec: TensorCodec | None = None,
    *,
    secret: str | bytes | None = None,
    disk_dir: str | os.PathLike[str] | None = None,
    disk_bytes: int = DEFAULT_DISK_BYTES,
    disk_write_through: bool = True,
    redis_url: str | None = None,
    redis_deployment: str | None = None,
    redis_ttl_s: float | None = None,
    redis_max_ttl_s: float = DEFAULT_MAX_TTL_S,
    redis_timeout_s: float = 0.25,
    redis_sync_writes: bool = False,
    pin_refresh_s: float | None = 60.0,
    encrypt: bool = False,
) -> list[DiskTier | RedisTier]:
    """Add a disk tier (if ``disk_dir``) then a Redis tier (if ``redis_url``) below ``cache``.

    Defaults come from the environment when an argument is None: ``PREFIXCACHE_DISK_CACHE``,
    ``PREFIXCACHE_REDIS_URL``, ``PREFIXCACHE_REDIS_DEPLOYMENT`` (key prefix; default "default";
    replicas of one deployment share blocks). Returns the tiers added (maybe none). Does not
    contact Redis: a Redis that is down only costs counted misses. With Redis and
    ``pin_refresh_s``, a daemon thread keeps the pinned (keep-warm) blocks alive in Redis.
    ``redis_sync_writes``: see :class:`RedisTier` (read-your-writes across replicas vs latency).
    ``secret``: the server's salt secret (default ``$PREFIXCACHE_SALT_SECRET``); the entries' MAC
    key is derived from it, so only processes sharing it read each other's entries (none given:
    a random key of this process). ``redis_max_ttl_s``: no Redis entry lives longer unused.
    ``encrypt``: entries written are sealed (ChaCha20-Poly1305, :mod:`.sealed`); needs a secret.
    """
    if codec is None:
        codec = TensorCodec.from_secret(
            secret or os.environ.get("PREFIXCACHE_SALT_SECRET") or None, encrypt=encrypt
        )
    disk_dir = disk_dir or os.environ.get("PREFIXCACHE_DISK_CACHE") or None
    redis_url = redis_url or os.environ.get("PREFIXCACHE_REDIS_URL") or None
    deployment = redis_deployment or os.environ.get("PREFIXCACHE_REDIS_DEPLOYMENT") or "default"
    added: list[DiskTier | RedisTier] = []
    if disk_dir:
        disk = DiskTier(disk_dir, capacity_bytes=disk_bytes, codec=codec, write_through=disk_write_through)
        cache.add_tier(disk)
        added.append(disk)
        log.info("cache tier: disk %s (%d bytes budget)", disk_dir, disk_bytes)
    if redis_url:
        rt = RedisTier(
            redis_url,
            deployment=deployment,
            ttl_s=redis_ttl_s,
            refresh_ttl_s=redis_ttl_s or cache.default_ttl_s,
            max_ttl_s=redis_max_ttl_s,
            codec=codec,
            socket_timeout_s=redis_timeout_s,
            connect_timeout_s=redis_timeout_s,
            sync_writes=redis_sync_writes,
        )
        cache.add_tier(rt)
        added.append(rt)
        log.info(
            "cache tier: redis %s (deployment %r, entries live at most %.0fs)",
            rt.url,
            deployment,
            rt.max_ttl_s,
        )
        if pin_refresh_s:
            start_pin_refresher(cache, pin_refresh_s)
    return added


def tier_stats(cache: PrefixCache) -> list[TierStats]:
    """Counters of every tier of ``cache``, in lookup order."""
    return [tier.stats() for tier in cache.tiers]


def flush_tiers(cache: PrefixCache, timeout: float | None = 30.0) -> None:
    """Wait until every tier's queued writes are done (tests, shutdown, keep-warm)."""
    for tier in cache.tiers:
        tier.flush(timeout)


def refresh_pinned(cache: PrefixCache, ttl_s: float | None = None) -> int:
    """Keep-warm in the shared tiers: extend the Redis expiry of every block pinned in ``cache``
    (re-writing those Redis lost). Returns the blocks found alive. O(blocks held): periodic use."""
    pinned = cache.pinned_blocks()  # a consistent view, taken under the cache's lock
    alive = 0
    for tier in cache.tiers:
        if isinstance(tier, RedisTier):
            alive += tier.refresh(pinned, ttl_s)
    return alive


def start_pin_refresher(
    cache: PrefixCache, interval_s: float = 60.0, ttl_s: float | None = None
) -> threading.Event:
    """A daemon thread calling :func:`refresh_pinned` every ``interval_s``. Set the returned
    event to stop it."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                refresh_pinned(cache, ttl_s or max(interval_s * 3, cache.default_ttl_s))
            except Exception:
                log.exception("keep-warm: refreshing pinned blocks in the shared tier failed")

    threading.Thread(target=loop, name="prefixcache-pin-refresher", daemon=True).start()
    return stop


def register_prometheus(cache: PrefixCache, registry: Any = None, prefix: str = "prefixcache_tier") -> Any:
    """Export tier counters as Prometheus metrics (``<prefix>_<field>{tier=...}``) on ``registry``
    (default: the global one). Returns the collector (unregister it to stop)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import REGISTRY

    gauges = {"entries", "bytes"}

    class _Collector:
        def collect(self) -> Sequence[Any]:
            stats = tier_stats(cache)
            families = []
            for field in TierStats.__dataclass_fields__:
                if field == "name":
                    continue
                name = f"{prefix}_{field}"
                doc = f"prefixcache tier {field}"
                fam: Any = (
                    GaugeMetricFamily(name, doc, labels=["tier"])
                    if field in gauges
                    else CounterMetricFamily(name, doc, labels=["tier"])
                )
                for s in stats:
                    fam.add_metric([s.name], getattr(s, field))
                families.append(fam)
            return families

    collector = _Collector()
    (registry or REGISTRY).register(collector)
    return collector
