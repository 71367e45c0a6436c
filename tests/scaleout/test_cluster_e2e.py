"""The whole stack in one process: real server apps over tiny-model Engines sharing a Redis tier,
the router in front, OpenAI and Anthropic clients' wire shapes."""

from __future__ import annotations

import time
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
    policy.chmod(0o600)  # it holds API keys: readable by its owner only
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


@pytest.mark.model
@pytest.mark.redis
def test_cluster_command_up_answers_through_the_router_and_stops_on_sigterm(
    tmp_path, redis_server_bin
) -> None:  # noqa: ANN001
    """``prefixcache cluster`` as a user runs it: its Redis is capped and password-protected (the
    password in no log and no command line), ``--tenant-capacity-share`` reaches the replica, the
    openai client is answered through the router,
    and SIGTERM stops the router, the replica and Redis (exit status 0, no process left)."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import openai
    import psutil
    import redis

    import prefixcache

    from .conftest import free_port, stop_process_tree, wait_http

    password = "cluster-test-password-0123456789"
    (tmp_path / "pw").write_text(password + "\n")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(prefixcache.__file__).resolve().parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, "-m", "prefixcache", "cluster", "--replicas", "1", "--port", str(port)]
    cmd += ["--redis-maxmemory", "256MiB", "--redis-password-file", str(tmp_path / "pw")]
    cmd += ["--log-level", "info", "--tenant-capacity-share", "0.4"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=300)
        except RuntimeError:
            raise AssertionError(log.read_text()[-3000:]) from None
        children = psutil.Process(proc.pid).children(recursive=True)
        names = sorted(c.name() for c in children)
        assert len(children) == 2 and "redis-server" in names, names  # the replica and Redis
        for c in children:
            assert password not in " ".join(c.cmdline())
        (replica,) = [c for c in children if c.name() != "redis-server"]
        argv = replica.cmdline()
        assert argv[argv.index("--tenant-capacity-share") + 1] == "0.4"  # passed on to each replica
        match = re.search(
            r"redis redis://:\*\*\*@127\.0\.0\.1:(\d+)/0 \(started: maxmemory 256MiB, allkeys-lru\)",
            log.read_text(),
        )
        assert match, log.read_text()[-3000:]
        with redis.Redis(port=int(match.group(1)), password=password) as r:
            assert r.config_get("maxmemory") == {"maxmemory": str(256 << 20)}
            assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            first = client.chat.completions.create(
                model="smollm2-135m-instruct", max_tokens=6, temperature=0, messages=messages
            )
            second = client.chat.completions.create(
                model="smollm2-135m-instruct", max_tokens=6, temperature=0, messages=messages
            )
            assert first.choices[0].message.content and second.choices == first.choices
            assert (
                second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16
            )
            assert r.dbsize() > 0  # the replica wrote its blocks to the password-protected Redis
        # The KV events reach the router over CURVE (the keys the cluster made): live and synced.
        import httpx

        deadline = time.monotonic() + 30
        while True:
            feeds = httpx.get(f"http://127.0.0.1:{port}/router/replicas", timeout=10).json()["kv_events"]
            if all(row["live"] and row["synced"] and row["blocks"] > 0 for row in feeds.values()):
                break
            assert time.monotonic() < deadline, feeds
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
        assert password not in log.read_text()
    finally:
        stop_process_tree(proc)
