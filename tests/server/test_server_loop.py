"""No block on the event loop (issue 11, item 2): while a tier read holds the cache lock for
2 s, ``/health`` answers in under 300 ms, and ``/metrics`` and ``GET /v1/cache`` answer their
last snapshot (with its age) instead of stalling the loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
from server_helpers import wait_until

from prefixcache.cache.tiers.base import TierStats
from prefixcache.server.ops.routes import STALE_HEADER

MODEL = "test-model"
STALL_S = 2.0


class StallingTier:
    """A tier whose reads take ``STALL_S`` while holding the cache's lock: a long hold of the
    lock. (The engine reads tiers outside the lock, in its prefetch; this tier takes the lock
    itself, as every tier read did before, to keep the lock held that long.)"""

    name = "stalling"
    write_through = False

    def __init__(self, cache: Any) -> None:
        self.reading = threading.Event()
        self.cache = cache

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[bytes], namespace: bytes, layout: Any = None
    ) -> list[tuple[Any, int]]:
        with self.cache.lock:
            self.reading.set()
            time.sleep(STALL_S)
        return []

    def put(self, block: Any) -> None:
        pass

    def stats(self) -> TierStats:
        return TierStats(self.name)

    def remove_namespace(self, namespace: bytes) -> int:
        return 0


def _timed(fn: Any) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = fn()
    return response, time.monotonic() - start


def test_health_metrics_and_cache_stats_answer_while_a_tier_read_holds_the_cache_lock(serve, make_engine):
    engine = make_engine()
    tier = StallingTier(engine.cache)
    engine.cache.add_tier(tier)
    server = serve(engine, model_name=MODEL)
    # One read of each while the cache is free: the snapshots served while it is not.
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/cache").status_code == 200
    prompt = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a miss " * 20}]}
    done: list[int] = []

    def generate() -> None:
        done.append(httpx.post(server.url + "/v1/chat/completions", json=prompt, timeout=60).status_code)

    stalled = threading.Thread(target=generate)
    stalled.start()
    assert tier.reading.wait(30)  # the engine's worker holds the cache lock in the tier read
    answers: dict[str, tuple[httpx.Response, float]] = {}

    def read(path: str) -> None:
        answers[path] = _timed(lambda: httpx.get(server.url + path))

    readers = [threading.Thread(target=read, args=(p,)) for p in ("/metrics", "/v1/cache")]
    for t in readers:
        t.start()
    time.sleep(0.3)  # let both reach the server: before the fix, either one blocked the loop here
    health, took = _timed(lambda: httpx.get(server.url + "/health", timeout=10))
    assert health.status_code == 200 and took < 0.3, took
    for t in readers:
        t.join(10)
    for path, (response, seconds) in answers.items():
        assert response.status_code == 200 and seconds < 1.0, (path, seconds)
        assert float(response.headers[STALE_HEADER]) > 0  # the last snapshot, not a fresh read
    assert "prefixcache_cache_blocks" in answers["/metrics"][0].text
    assert answers["/v1/cache"][0].json()["tenant"] == "default"
    stalled.join(30)
    assert done == [200]
    # Once the lock is free again the reads are fresh (no age header).
    wait_until(lambda: STALE_HEADER not in httpx.get(server.url + "/metrics").headers, "a fresh /metrics")
    assert STALE_HEADER not in httpx.get(server.url + "/v1/cache").headers


def test_a_first_read_while_the_lock_is_held_is_503_cache_busy(serve, make_engine):
    engine = make_engine()
    tier = StallingTier(engine.cache)
    engine.cache.add_tier(tier)
    server = serve(engine, model_name=MODEL)
    prompt = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "a miss " * 20}]}
    url = server.url + "/v1/chat/completions"
    stalled = threading.Thread(target=lambda: httpx.post(url, json=prompt, timeout=60))
    stalled.start()
    assert tier.reading.wait(30)
    r = httpx.get(server.url + "/v1/cache")  # no snapshot yet for this tenant
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "cache_busy"
    stalled.join(30)
