"""The whole stack in one process: real server apps over tiny-model Engines sharing a Redis tier,
the router in front, OpenAI and Anthropic clients' wire shapes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from prefixcache.cache import PrefixCache
from prefixcache.cache.tiers import attach_tiers, flush_tiers, register_prometheus
from prefixcache.engine.engine import Engine
from prefixcache.router import RouterConfig, create_router_app
from prefixcache.server import create_app

from .conftest import ServerThread

SYSTEM = "You are the support assistant of Acme Corp. Answer briefly and politely. " * 4


def replica(runner: Any, redis_url: str) -> tuple[Engine, Any]:
    cache = PrefixCache(block_size=16)
    attach_tiers(cache, redis_url=redis_url, pin_refresh_s=None)
    engine = Engine(runner, prefill_chunk=16, cache=cache)
    app = create_app(engine, salt_secret="shared-secret", model_name="tiny")
    register_prometheus(cache, app.state.prefixcache.metrics.registry)
    return engine, app


@pytest.mark.redis
def test_round_robin_replicas_share_prefixes_through_redis(tiny_runner, redis_url) -> None:  # noqa: ANN001
    (ea, app_a), (eb, app_b) = replica(tiny_runner, redis_url), replica(tiny_runner, redis_url)
    try:
        with ServerThread(app_a) as a, ServerThread(app_b) as b:
            router = create_router_app(RouterConfig([a.url, b.url], policy="round-robin"))
            with ServerThread(router) as r, httpx.Client(base_url=r.url, timeout=60) as c:
                body = {
                    "model": "tiny",
                    "max_tokens": 4,
                    "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                }
                first = c.post("/v1/chat/completions", json=body)
                assert first.status_code == 200, first.text
                assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                flush_tiers(ea.cache)
                flush_tiers(eb.cache)
                second = c.post("/v1/chat/completions", json=body)  # the other replica
                assert second.headers["x-prefixcache-replica"] != first.headers["x-prefixcache-replica"]
                cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt = second.json()["usage"]["prompt_tokens"]
                assert cached == (prompt - 1) // 16 * 16 > 0  # every full chunk, from Redis
                assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
                # Anthropic shape, streamed, through the router: usage read from message_start.
                anth = {
                    "model": "tiny",
                    "max_tokens": 4,
                    "system": SYSTEM,
                    "stream": True,
                    "messages": [{"role": "user", "content": "Hi"}],
                }
                with c.stream("POST", "/v1/messages", json=anth) as s:
                    assert s.status_code == 200
                    text = "".join(s.iter_text())
                assert "cache_read_input_tokens" in text and "message_stop" in text
                snap = c.get("/router/replicas").json()["replicas"]
                assert sum(x["cached_tokens"] for x in snap) >= cached
            metrics = httpx.get(b.url + "/metrics").text + httpx.get(a.url + "/metrics").text
            assert 'prefixcache_tier_hits_total{tier="redis"}' in metrics
    finally:
        ea.close()
        eb.close()


@pytest.mark.redis
def test_keep_warm_policy_pins_the_prefix_on_every_real_replica(tiny_runner, redis_url, tmp_path) -> None:  # noqa: ANN001
    import json
    import time

    (ea, app_a), (eb, app_b) = replica(tiny_runner, redis_url), replica(tiny_runner, redis_url)
    policy = tmp_path / "warm.json"
    policy.write_text(
        json.dumps(
            {
                "interval_s": 3600,
                "prefixes": [{"name": "support", "messages": [{"role": "system", "content": SYSTEM}]}],
            }
        )
    )
    try:
        with ServerThread(app_a) as a, ServerThread(app_b) as b:
            router = create_router_app(RouterConfig([a.url, b.url], keepwarm_file=str(policy)))
            with ServerThread(router):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not (
                    ea.cache.pinned_prefixes() == 1 and eb.cache.pinned_prefixes() == 1
                ):
                    time.sleep(0.05)
                assert ea.cache.pinned_prefixes() == 1 and eb.cache.pinned_prefixes() == 1
                assert ea.cache.stats().pinned_blocks > 0
                ea.cache.check_integrity()
                eb.cache.check_integrity()
    finally:
        ea.close()
        eb.close()
