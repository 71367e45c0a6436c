"""RedisTier: blocks shared across replicas through one Redis, with expiry and a circuit breaker.

Each block is one Redis string ``<prefix><deployment>:kv:<namespace tag>:<key hex>`` holding a
:mod:`codec` entry (header, token ids, tensor bytes, MAC), set with ``EX``: the block's TTL (or
the tier's), never more than ``max_ttl_s``, whatever a client asked for. The namespace tag (a
keyed digest of the tenant's namespace root) lets :meth:`RedisTier.remove_namespace` find a
tenant's entries with ``SCAN MATCH`` and leave every other tenant's. A lookup reads the run of
keys with pipelined ``MGET`` batches and stops at the first missing or bad entry; a bad entry
(MAC, layout, key, parent, tokens) is a counted miss, never served, and deleted. Hits refresh
the expiry in the background (``EXPIRE ... GT``: never shortens a longer TTL).

The URL's password never reaches a log: the tier logs :func:`redacted_url`.

Redis is an optimisation, never a dependency of correctness: every backend failure (refused
connection, socket timeout, protocol error) is caught, counted in ``errors``, and answered as a
miss, so the engine recomputes. After a failure a circuit breaker opens for ``backoff_s``
(doubling up to ``max_backoff_s``): meanwhile lookups and writes are skipped at no cost, so a
dead Redis does not add a socket timeout to every request. The first call after the backoff
probes again; a success closes the breaker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from prefixcache.cache.blocks import Block
from prefixcache.cache.config import DEFAULTS
from prefixcache.cache.tiers.base import BackgroundWriter, TierStats
from prefixcache.cache.tiers.codec import BlockLayout, CorruptEntry, TensorCodec

if TYPE_CHECKING:
    import redis as redis_lib

log = logging.getLogger(__name__)

#: The longest expiry a Redis entry gets by default: an hour (a client's "24h" retention class
#: keeps its blocks in memory that long, in the shared Redis at most this long unused).
DEFAULT_MAX_TTL_S = 3600.0


def redacted_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: what logs and messages show."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:  # an unparsable URL: show none of it
        return "redis://***"


@dataclass(slots=True)
class CircuitBreaker:
    """Open after a failure for ``backoff`` seconds, doubling per consecutive failure."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    open_until: float = 0.0
    failures: int = 0  # consecutive

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    @property
    def is_open(self) -> bool:
        return not self.allow()

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0

    def failure(self) -> None:
        delay = min(self.backoff_s * (2**self.failures), self.max_backoff_s)
        self.failures += 1
        self.open_until = self.clock() + delay


class RedisTier:
    """A shared tier in Redis. Thread-safe; never raises on backend failure.

    Writes are asynchronous by default: the request path only enqueues, so a request that
    reaches another replica a few milliseconds later may not see the blocks yet (measured: 9 of
    20 back-to-back follow-ups missed). ``sync_writes=True`` writes inside ``put``, i.e. inside
    the cache's commit, before the request's decode starts: read-your-writes across replicas, at
    the cost of one ``SET`` round trip per new block on the request path (bounded by the socket
    timeout and skipped while the breaker is open).

    ``client`` may be given (tests); otherwise one is made from ``url`` with short socket
    timeouts and no client-side retries (the breaker decides when to retry).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        deployment: str = "default",
        prefix: str = "prefixcache:",
        ttl_s: float | None = None,
        refresh_ttl_s: float = DEFAULTS.default_ttl_s,
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
        codec: TensorCodec | None = None,
        write_through: bool = True,
        sync_writes: bool = False,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        batch_blocks: int = 8,
        queue_size: int = 1024,
        queue_bytes: int = 256 << 20,
        name: str = "redis",
        client: redis_lib.Redis | None = None,
    ) -> None:
        self.name = name
        self.write_through = write_through
        self.sync_writes = sync_writes
        if not max_ttl_s >= 1:
            raise ValueError(f"max_ttl_s must be >= 1 second; got {max_ttl_s}")
        self.url = redacted_url(url)  # for messages; the client keeps the real one
        self.key_prefix = f"{prefix}{deployment}:kv:"
        self.max_ttl_s = float(max_ttl_s)
        self.ttl_s = ttl_s
        self.refresh_ttl_s = refresh_ttl_s
        self.codec = codec or TensorCodec()
        self.batch_blocks = max(1, batch_blocks)
        self.breaker = CircuitBreaker(backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._lock = threading.Lock()
        self._stats = TierStats(name=name)
        self._expire_gt = True  # EXPIRE ... GT needs Redis >= 7; fall back when refused
        if client is None:
            import redis as redis_lib
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            client = redis_lib.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        self.client = client
        self._writer = BackgroundWriter(name, maxsize=queue_size, max_bytes=queue_bytes)

    def redis_key(self, key: bytes, namespace: bytes) -> str:
        """The Redis name of block ``key`` of namespace root ``namespace``."""
        return f"{self.key_prefix}{self.codec.namespace_tag(namespace)}:{key.hex()}"

    def capped_ttl(self, ttl_s: float) -> int:
        """Whole seconds of expiry for a requested ``ttl_s``: at least 1, at most ``max_ttl_s``."""
        return max(1, math.ceil(min(ttl_s, self.max_ttl_s)))

    # ------------------------------------------------------------------ Tier protocol
    def get_many(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[bytes],
        namespace: bytes,
        layout: BlockLayout | None = None,
    ) -> list[tuple[Any, int]]:
        """Payloads of the leading run of ``keys`` held in Redis and verified. On any backend
        failure: what was verified so far (possibly nothing), a counted error, breaker opened."""
        import redis as redis_lib

        if not self.breaker.allow():
            with self._lock:
                self._stats.skipped += 1
            return []
        out: list[tuple[Any, int]] = []
        hit_keys: list[str] = []
        try:
            for start in range(0, len(keys), self.batch_blocks):
                batch = keys[start : start + self.batch_blocks]
                values = self.client.mget([self.redis_key(key, namespace) for key in batch])
                stop = False
                for offset, value in enumerate(values):
                    index = start + offset
                    if value is None:
                        with self._lock:
                            self._stats.misses += 1
                        stop = True
                        break
                    if isinstance(value, str):  # a client built with decode_responses
                        value = value.encode("latin-1")
                    try:
                        parent = keys[index - 1] if index else False
                        entry = self.codec.decode(
                            value, key=keys[index], tokens=tokens[index], parent=parent, layout=layout
                        )
                    except CorruptEntry as exc:
                        log.warning(
                            "redis tier: corrupt entry %s (%s): deleted, not served",
                            keys[index].hex()[:12],
                            exc,
                        )
                        with self._lock:
                            self._stats.corrupt += 1
                        self.client.delete(self.redis_key(keys[index], namespace))
                        stop = True
                        break
                    out.append((entry.payload, entry.nbytes))
                    hit_keys.append(self.redis_key(keys[index], namespace))
                if stop:
                    break
        except redis_lib.RedisError as exc:
            self._failed("read", exc)
        else:
            self.breaker.success()
        with self._lock:
            self._stats.hits += len(out)
        if hit_keys:
            self._writer.submit(lambda: self._expire(hit_keys, self.refresh_ttl_s))
        return out

    def put(self, block: Block) -> None:
        """Write ``block`` with its TTL (in the background unless ``sync_writes``); dropped
        (counted) if the breaker is open."""
        if not self.breaker.allow():
            with self._lock:
                self._stats.skipped += 1
                self._stats.write_drops += 1
            return
        ttl = self.ttl_s if self.ttl_s is not None else block.ttl_s
        write = functools.partial(
            self._write, block.key, block.namespace, block.parent, block.tokens, block.payload, ttl
        )
        if self.sync_writes:
            write()
            return
        if not self._writer.submit(write, block.nbytes):
            with self._lock:
                self._stats.write_drops += 1

    def remove_namespace(self, namespace: bytes) -> int:
        """Delete every entry of the namespace root ``namespace`` (``SCAN MATCH`` on its tag, then
        ``UNLINK`` in batches), after the writes queued so far. Returns entries removed; on a
        backend failure, those removed before it (counted as an error)."""
        import redis as redis_lib

        self._writer.flush(30.0)
        pattern = f"{self.key_prefix}{self.codec.namespace_tag(namespace)}:*"
        removed = 0
        try:
            batch: list[bytes] = []
            for name in self.client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 500:
                    removed += int(self.client.unlink(*batch))
                    batch = []
            if batch:
                removed += int(self.client.unlink(*batch))
        except redis_lib.RedisError as exc:
            self._failed("remove namespace", exc)
        return removed

    def remove_keys(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Delete the entries ``keys`` of the namespace root ``namespace`` (after the writes queued
        so far; the exactness audit's removal of blocks found wrong). Returns entries removed."""
        import redis as redis_lib

        self._writer.flush(30.0)
        if not keys:
            return 0
        try:
            return int(self.client.unlink(*[self.redis_key(key, namespace) for key in keys]))
        except redis_lib.RedisError as exc:
            self._failed("remove keys", exc)
            return 0

    # ------------------------------------------------------------------ keep-warm and admin
    def refresh(self, blocks: Sequence[Block], ttl_s: float | None = None) -> int:
        """Extend the expiry of ``blocks`` in Redis, re-writing those that are gone (keep-warm).
        Synchronous. Returns the number found alive; 0 on failure (counted)."""
        import redis as redis_lib

        if not blocks or not self.breaker.allow():
            return 0
        ttl = self.capped_ttl(ttl_s or self.ttl_s or self.refresh_ttl_s)
        try:
            pipe = self.client.pipeline(transaction=False)
            for block in blocks:
                pipe.expire(self.redis_key(block.key, block.namespace), ttl)
            alive = pipe.execute()
        except redis_lib.RedisError as exc:
            self._failed("refresh", exc)
            return 0
        self.breaker.success()
        for block, found in zip(blocks, alive, strict=True):
            if not found:  # gone from Redis: write it again
                self._writer.submit(
                    functools.partial(
                        self._write,
                        block.key,
                        block.namespace,
                        block.parent,
                        block.tokens,
                        block.payload,
                        ttl,
                    )
                )
        return sum(1 for found in alive if found)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued write has been sent."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):  # closing a dead connection
            self.client.close()

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self._stats.as_dict())

    # ------------------------------------------------------------------ internals
    def _failed(self, what: str, exc: Exception) -> None:
        self.breaker.failure()
        with self._lock:
            self._stats.errors += 1
        log.warning(
            "redis tier %s: %s failed (%s: %s); recomputing, retry in %.1fs",
            self.url,
            what,
            type(exc).__name__,
            exc,
            self.breaker.open_until - self.breaker.clock(),
        )

    def _write(
        self, key: bytes, namespace: bytes, parent: bytes | None, tokens: bytes, payload: Any, ttl_s: float
    ) -> None:
        import redis as redis_lib

        if not self.breaker.allow():
            with self._lock:
                self._stats.skipped += 1
                self._stats.write_drops += 1
            return
        try:
            data = self.codec.encode(key, parent, tokens, payload)
        except (TypeError, ValueError) as exc:
            log.warning("redis tier: cannot encode block %s: %s", key.hex()[:12], exc)
            with self._lock:
                self._stats.write_drops += 1
            return
        try:
            self.client.set(self.redis_key(key, namespace), data, ex=self.capped_ttl(ttl_s))
        except redis_lib.RedisError as exc:
            self._failed("write", exc)
            with self._lock:
                self._stats.write_drops += 1
            return
        self.breaker.success()
        with self._lock:
            self._stats.writes += 1

    def _expire(self, names: list[str], ttl_s: float) -> None:
        import redis as redis_lib

        if not self.breaker.allow():
            return
        ttl = self.capped_ttl(ttl_s)
        try:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                if self._expire_gt:
                    pipe.expire(name, ttl, gt=True)
                else:
                    pipe.expire(name, ttl)
            pipe.execute()
        except redis_lib.ResponseError:
            self._expire_gt = False  # an old Redis without EXPIRE ... GT
        except redis_lib.RedisError as exc:
            self._failed("expire", exc)
