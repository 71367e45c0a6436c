"""The router with the replicas' KV events: a prefix evicted on a replica stops attracting
requests to it (tiny-model replicas in-process, real HTTP and ZeroMQ on loopback)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from prefixcache.cache import PrefixCache
from prefixcache.engine.engine import Engine
from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
from prefixcache.router import RouterConfig, create_router_app
from prefixcache.router.kv_index import FeedSpec, parse_feed
from prefixcache.server import create_app
from prefixcache.server.compat.kv_blocks import enable_kv_events

from .conftest import ServerThread

SYSTEM = "You are the billing assistant of Acme Corp. Answer in one short sentence. " * 4


def body(system: str, user: str = "Hi") -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def replica(runner: Any, capacity_bytes: int) -> tuple[Engine, Any, KVEventPublisher]:
    engine = Engine(runner, prefill_chunk=16, cache=PrefixCache(block_size=16, capacity_bytes=capacity_bytes))
    app = create_app(engine, model_name="tiny")
    publisher = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    enable_kv_events(app, publisher)
    return engine, app, publisher


def until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def block_bytes(runner: Any) -> int:
    """One block's KV bytes in the tiny model (from a throwaway engine's cache)."""
    engine = Engine(runner, prefill_chunk=16)
    try:
        engine.generate(prompt_token_ids=list(range(33)), max_tokens=1)
        stats = engine.stats()
        return stats.bytes // stats.blocks
    finally:
        engine.close()


def test_an_evicted_prefix_is_routed_by_load_not_to_the_replica_that_lost_it(tiny_runner) -> None:  # noqa: ANN001
    capacity = 40 * block_bytes(tiny_runner)  # room for two prompts of ~20 blocks, not three
    (ea, app_a, pa), (eb, app_b, pb) = replica(tiny_runner, capacity), replica(tiny_runner, capacity)
    try:
        with ServerThread(app_a) as a, ServerThread(app_b) as b:
            feeds = {
                a.url: FeedSpec(pa.endpoint, pa.replay_endpoint),
                b.url: FeedSpec(pb.endpoint, pb.replay_endpoint),
            }
            router_app = create_router_app(RouterConfig([a.url, b.url], "cache-aware", kv_events=feeds))
            plain_app = create_router_app(RouterConfig([a.url, b.url], "cache-aware"))  # no events
            index = router_app.state.router.kv_index
            with (
                ServerThread(router_app) as r,
                ServerThread(plain_app) as plain,
                httpx.Client(timeout=60) as c,
            ):
                until(lambda: all(v["synced"] for v in index.snapshot().values()), "both feeds in sync")
                first = c.post(r.url + "/v1/chat/completions", json=body(SYSTEM))
                assert first.status_code == 200, first.text
                assert "x-prefixcache-blocks" not in first.headers  # the router's, not the client's
                holder = first.headers["x-prefixcache-replica"]
                other = b.url if holder == a.url else a.url
                until(lambda: len(index.anchors) > 0, "the prompt's anchors")
                until(lambda: index.snapshot()[holder]["blocks"] > 0, "the holder's BlockStored")
                assert index.snapshot()[other]["blocks"] == 0

                again = c.post(r.url + "/v1/chat/completions", json=body(SYSTEM, "Hello"))
                assert again.headers["x-prefixcache-replica"] == holder  # its blocks are there
                assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

                # A streamed response teaches the router too (the header precedes the stream).
                learned = len(index.anchors)
                streamed = {
                    **body("A streamed prompt about shipping rates and parcels. " * 6),
                    "stream": True,
                }
                with c.stream("POST", r.url + "/v1/chat/completions", json=streamed) as s:
                    assert s.status_code == 200 and "x-prefixcache-blocks" not in s.headers
                    s.read()
                assert len(index.anchors) > learned

                # Fill the holder directly (not through the router) until the prefix is evicted.
                for i in range(2):
                    filler = body(f"Unrelated filler prompt number {i}. " * 10)
                    assert c.post(holder + "/v1/chat/completions", json=filler).status_code == 200
                held_keys = index.anchors.blocks()
                until(
                    lambda: not any(h in index.replicas[holder].held for h in held_keys),
                    "the holder's BlockRemoved for the prefix",
                )

                # The record still says the holder; the events say it lost the prefix: by load.
                third = c.post(r.url + "/v1/chat/completions", json=body(SYSTEM, "Bonjour"))
                assert third.status_code == 200, third.text
                assert third.headers["x-prefixcache-replica"] == other
                assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                snap = c.get(r.url + "/router/replicas").json()
                assert snap["kv_events"][holder]["synced"] and snap["kv_events"][holder]["lost"] == 0
                metrics = c.get(r.url + "/metrics").text
                assert f'prefixcache_router_kv_events_synced{{replica="{holder}"}} 1.0' in metrics

                # Control: the same history through a router without events goes to the holder.
                plain_holder = c.post(plain.url + "/v1/chat/completions", json=body(SYSTEM, "Hey"))
                ph = plain_holder.headers["x-prefixcache-replica"]
                for i in range(2):
                    filler = body(f"Another unrelated filler prompt {i}. " * 10)
                    assert c.post(ph + "/v1/chat/completions", json=filler).status_code == 200
                blind = c.post(plain.url + "/v1/chat/completions", json=body(SYSTEM, "Hallo"))
                assert blind.headers["x-prefixcache-replica"] == ph
                assert blind.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        for e in (ea, eb):
            e.close()
        for p in (pa, pb):
            p.close()


def test_kv_events_flag_is_checked() -> None:
    assert parse_feed("http://h:8000/=tcp://h:5557,tcp://h:5558") == (
        "http://h:8000",
        FeedSpec("tcp://h:5557", "tcp://h:5558"),
    )
    with pytest.raises(ValueError, match="REPLICA_URL=PUB_ENDPOINT"):
        parse_feed("tcp://h:5557")
    with pytest.raises(ValueError, match="not a ZeroMQ address"):
        parse_feed("http://h:8000=h:5557")
    with pytest.raises(ValueError, match="not a --replica"):
        create_router_app(RouterConfig(["http://a:1"], kv_events={"http://b:1": FeedSpec("tcp://b:2")}))
    with pytest.raises(ValueError, match="needs --policy cache-aware"):
        create_router_app(
            RouterConfig(["http://a:1"], "round-robin", kv_events={"http://a:1": FeedSpec("tcp://a:2")})
        )


def test_the_commands_reject_bad_kv_event_flags_with_a_fix() -> None:
    from typer.testing import CliRunner

    from prefixcache.cli import app

    def said(res: Any) -> str:  # the error box's text, unwrapped
        return " ".join(res.output.replace("│", " ").split())

    runner = CliRunner()
    res = runner.invoke(app, ["route", "--replica", "http://x:1", "--kv-events", "tcp://x:2"])
    assert res.exit_code == 2 and "REPLICA_URL=PUB_ENDPOINT" in said(res)
    res = runner.invoke(app, ["route", "--replica", "http://x:1", "--kv-events", "http://y:1=tcp://y:2"])
    assert res.exit_code == 2 and "not a --replica" in said(res)
    # serve checks its KV event flags before loading the model (no model loads here).
    res = runner.invoke(app, ["serve", "--kv-events-endpoint", "127.0.0.1:5557"])
    assert res.exit_code == 2 and "tcp://127.0.0.1:5557" in said(res)
    res = runner.invoke(app, ["serve", "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"])
    assert res.exit_code == 2 and "needs --kv-events-endpoint" in said(res)
    res = runner.invoke(
        app, ["serve", "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-hash-format", "hex"]
    )
    assert res.exit_code == 2 and "not int or bytes" in said(res)
