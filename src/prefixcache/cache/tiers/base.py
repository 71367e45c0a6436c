"""What the tiers share: the :class:`Tier` protocol, counters and a bounded background writer.

A tier's ``put`` is called by :class:`~prefixcache.cache.manager.PrefixCache` while it holds its
lock (write-through on commit, demotion on eviction; see :mod:`~prefixcache.cache.tiers.stack`),
so it must be quick and must not raise: it only enqueues; a daemon thread encodes and writes. When
the queue is full the block is dropped (counted): a tier is a cache, losing a write costs a
recompute later, never correctness.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prefixcache.cache.blocks import Block
from prefixcache.cache.keys import BlockHash
from prefixcache.cache.tiers.codec import BlockLayout

log = logging.getLogger(__name__)


class Tier(Protocol):
    """A store below memory (disk, Redis) under the same keys, verified on read."""

    name: str
    #: True: every committed block is written at once (shared tiers); False: on eviction only.
    write_through: bool

    def get_many(
        self,
        keys: Sequence[BlockHash],
        tokens: Sequence[bytes],
        namespace: bytes,
        layout: BlockLayout | None = None,
    ) -> list[tuple[Any, int]]:
        """(payload, nbytes) of the leading run of ``keys`` (of namespace root ``namespace``)
        held and verified by this tier, in order; stops at the first block missing or failing
        verification (may be empty). ``layout``: the only payload shape and dtype accepted."""
        ...

    def put(self, block: Block) -> None:
        """Persist one block (key, parent, tokens, payload). Quick, and must not raise on a
        backend failure (it is called under the cache's lock)."""
        ...

    def remove_namespace(self, namespace: bytes) -> int:
        """Delete every entry of namespace root ``namespace`` this tier holds (a tenant's
        ``DELETE /v1/cache``); other namespaces' entries stay. Returns entries removed. Not
        called under the cache's lock; must not raise on a backend failure (returns what it
        removed)."""
        ...

    def stats(self) -> TierStats:
        """A copy of this tier's counters."""
        ...

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued write is done: True, or False once ``timeout`` passes."""
        ...


@dataclass(slots=True)
class TierStats:
    """Counters of one tier, in blocks unless said otherwise. Monotonic except ``entries``/``bytes``."""

    name: str
    hits: int = 0  # blocks served (verified)
    misses: int = 0  # lookups that found nothing at the head of the run
    corrupt: int = 0  # entries that failed verification: counted as misses, never served, deleted
    errors: int = 0  # backend failures (I/O error, Redis down or timed out)
    skipped: int = 0  # lookups or writes skipped while the circuit breaker was open
    writes: int = 0  # blocks persisted
    write_drops: int = 0  # blocks not persisted (queue full, breaker open, encode failure)
    evictions: int = 0  # entries removed by this tier's own budget
    entries: int = 0  # entries held now (where the tier knows)
    bytes: int = 0  # bytes held now (where the tier knows)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BackgroundWriter:
    """One daemon thread draining a bounded queue of jobs (callables).

    Bounded twice: ``maxsize`` jobs and ``max_bytes`` of payload waiting (a queued job keeps its
    block's tensor alive, so the byte bound is what caps memory). ``submit`` never blocks: it
    returns False when either bound is reached. ``flush`` waits until every job submitted before
    it has run (tests and shutdown use it). ``close`` drains and stops.
    """

    def __init__(self, name: str, maxsize: int = 1024, max_bytes: int = 256 << 20) -> None:
        self._queue: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(target=self._run, name=f"prefixcache-{name}-writer", daemon=True)
        self._closed = False
        self._max_bytes = max_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> bool:
        if self._closed:
            return False
        with self._lock:
            if self._pending_bytes and self._pending_bytes + nbytes > self._max_bytes:
                return False
            self._pending_bytes += nbytes
        try:
            self._queue.put_nowait((job, nbytes))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= nbytes
            return False
        return True

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until the queue is drained (True) or ``timeout`` passes (False)."""
        done = threading.Event()
        if self._closed:
            return True
        try:
            self._queue.put((done.set, 0), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:  # pragma: no cover - only if a job hangs
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, nbytes = item
            try:
                job()
            except Exception:  # a tier write must never kill the writer
                log.exception("background tier write failed")
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
