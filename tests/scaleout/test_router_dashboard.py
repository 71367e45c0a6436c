"""The router's dashboard: where the record places prefixes, the replica rows in JSON and in
headless Chromium, and the API's keys (checked by the replicas)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixcache.cache import FakeClock
from prefixcache.router import RouterConfig, create_router_app
from prefixcache.router.policies import PrefixRecord
from prefixcache.server import create_app

from .conftest import ServerThread

MODEL = "m"
KEYS = {"sk-a": "alpha", "sk-b": "beta"}
SYSTEM = "Router dashboard test: a system prompt long enough for several chunks. " * 12


def test_prefix_record_counts_live_entries_per_replica() -> None:
    clock = FakeClock(0.0)
    rec = PrefixRecord(max_entries=4, ttl_s=10.0, clock=clock)
    rec.record(["c1", "c2"], "http://a")
    clock.advance(5)
    rec.record(["c3"], "http://b")
    assert rec.held_by() == {"http://a": 2, "http://b": 1}
    rec.record(["c2"], "http://b")  # c2 moves to b
    assert rec.held_by() == {"http://a": 1, "http://b": 2}
    rec.forget(["c3", "c1"], "http://b")  # only b's own entries go: c3, not a's c1
    assert rec.held_by() == {"http://a": 1, "http://b": 1}
    rec.record(["d1", "d2", "d3", "d4"], "http://c")  # past max_entries: the oldest (c1, c2) drop
    assert rec.held_by() == {"http://c": 4} and len(rec) == 4
    clock.advance(11)  # all expired
    assert rec.held_by() == {} and len(rec) == 0


@pytest.fixture
def cluster(tiny_runner: Any) -> Iterator[dict[str, Any]]:
    """Two tiny-model replicas (with keys) behind a cache-aware router, all on loopback."""
    import torch

    from prefixcache.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engines = [Engine(tiny_runner, prefill_chunk=16) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(ServerThread(create_app(e, model_name=MODEL, api_keys=KEYS, salt_secret="s")))
            for e in engines
        ]
        config = RouterConfig(
            replicas=[r.url for r in replicas], health_interval_s=0.05, dashboard_interval_s=0.05
        )
        app = create_router_app(config)
        router = stack.enter_context(ServerThread(app))
        try:
            yield {"router": router, "replicas": replicas, "state": app.state.router}
        finally:
            for e in engines:
                e.close()
            torch.set_num_threads(threads)


def chat(url: str, user: str, key: str = "sk-a") -> dict:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_router_dashboard_rows_and_page(cluster: dict[str, Any], browse: Any) -> None:
    url = cluster["router"].url
    usages = [chat(url, f"q{i}") for i in range(3)]
    assert [u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages] == [False, True, True]

    assert httpx.get(url + "/router/dashboard").status_code == 401  # the replicas' answer
    assert httpx.get(url + "/router/dashboard", headers={"x-api-key": "sk-nope"}).status_code == 401
    d = httpx.get(url + "/router/dashboard", headers={"authorization": "Bearer sk-a"}).json()
    assert d["policy"] == "cache-aware" and d["totals"]["replicas"] == 2 and d["totals"]["healthy"] == 2
    rows = {r["url"]: r for r in d["replicas"]}
    held = cluster["state"].prefixes_by_replica()
    (home,) = held  # cache-aware: every request of the prefix went to one replica
    assert rows[home]["prefixes"] == held[home] > 0 and rows[home]["routed"] == 3
    other = next(u for u in rows if u != home)
    assert rows[other]["prefixes"] == 0 and rows[other]["routed"] == 0
    # The hit rate comes from the usage the router parsed: the replica's own totals agree.
    replica_totals = httpx.get(home + "/v1/dashboard", headers={"authorization": "Bearer sk-a"}).json()[
        "totals"
    ]
    assert (
        rows[home]["prompt_tokens"]
        == replica_totals["prompt_tokens"]
        == sum(u["prompt_tokens"] for u in usages)
    )
    assert rows[home]["cached_tokens"] == replica_totals["cached_tokens"] > 0
    assert rows[home]["hit_rate"] == round(
        replica_totals["cached_tokens"] / replica_totals["prompt_tokens"], 4
    )
    assert d["totals"]["record_entries"] == held[home]

    dom = browse(url + "/dashboard#key=sk-b")  # another tenant's key: the router page is not per tenant
    assert dom.by_id("status")[1]["class"] == "ok"
    table = {r[0]: r for r in dom.rows("replicas")}
    assert set(table) == set(rows)
    assert (
        table[home][1] == "up"
        and table[home][3] == "3"
        and table[home][6] == f"{100 * rows[home]['hit_rate']:.1f}%"
    )
    assert table[home][9] == str(held[home]) and table[other][9] == "0"
    assert dom.value("healthy") == 2 and dom.value("routed") == 3

    # A replica that stops answering shows as down.
    stopped = next(r for r in cluster["replicas"] if r.url == other)
    stopped.__exit__(None, None, None)
    deadline = time.monotonic() + 30
    while cluster["state"].by_url(other).healthy:
        assert time.monotonic() < deadline, "the router never noticed the stopped replica"
        time.sleep(0.02)
    dom = browse(url + "/dashboard#key=sk-a")
    table = {r[0]: r for r in dom.rows("replicas")}
    assert table[other][1] == "down" and table[home][1] == "up" and dom.value("healthy") == 1
