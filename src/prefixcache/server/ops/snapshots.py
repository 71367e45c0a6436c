"""Reads that may wait for the cache lock, kept off the event loop.

``GET /metrics`` and ``GET /v1/cache`` read the cache's counters under its lock, which a tier
read (a slow Redis, a stalled disk) can hold for seconds. Run on the loop, such a read would
stall every other request, ``/health`` included. :class:`SnapshotReader` runs each read in its
own small thread pool, waits for it at most ``timeout_s``, and otherwise answers the last value
that read returned (a snapshot, with its age). At most one read per key is in flight: a scraper
polling a stalled cache does not pile up threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 0.25


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A read's value and its age in seconds (0.0: read just now, within the timeout)."""

    value: Any
    age_s: float

    @property
    def stale(self) -> bool:
        return self.age_s > 0.0


class SnapshotReader:
    """Blocking reads off the loop, bounded in time and in threads (see the module docstring).
    Thread-safe; :meth:`read` is called from the event loop."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 2) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="prefixcache-snapshot")
        self._lock = threading.Lock()
        self._in_flight: dict[Hashable, concurrent.futures.Future[Any]] = {}
        self._last: dict[Hashable, tuple[Any, float]] = {}  # key -> (value, time.monotonic() read)

    async def read(self, key: Hashable, fn: Callable[[], Any]) -> Snapshot | None:
        """``fn()`` if it returns within the timeout (joining a read of ``key`` already in flight),
        else the last value a read of ``key`` returned, else None. An exception of ``fn`` is
        raised (the last value is kept for the next caller)."""
        with self._lock:
            future = self._in_flight.get(key)
            started = future is None
            if future is None:
                future = self._pool.submit(fn)
                self._in_flight[key] = future
        if started:  # outside the lock: a future already done runs the callback at once, here
            future.add_done_callback(functools.partial(self._done, key))
        try:
            value = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except TimeoutError:
            with self._lock:
                last = self._last.get(key)
            if last is None:
                return None
            return Snapshot(last[0], max(time.monotonic() - last[1], 1e-6))
        return Snapshot(value, 0.0)

    def _done(self, key: Hashable, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._in_flight.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self._last[key] = (future.result(), time.monotonic())

    def close(self) -> None:
        """Stop taking reads; a read still blocked finishes in its thread and is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
