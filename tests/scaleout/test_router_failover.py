"""The router's fail-over rules and body bounds, against fake replica processes killed at known
points: retried only before any byte reached the client and at most once; a broken stream is
ended with an error event and counted, never retried; a slow replica stays in rotation; a
replica marked down comes back when its health check passes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from prefixcache.router import RouterConfig, create_router_app

from .conftest import FakeReplica, ServerThread

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FULL_STREAM = [
    'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hello"}}]}',
    'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": " world"}}]}',
]


def wait_until(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def snapshot(url: str) -> dict[str, Any]:
    return httpx.get(url + "/router/replicas", timeout=10).json()


def replica_row(snap: dict[str, Any], rep: FakeReplica) -> dict[str, Any]:
    return next(r for r in snap["replicas"] if r["url"] == rep.url)


def router(reps: list[FakeReplica], **config: Any) -> ServerThread:
    # Round-robin starts at the first replica: the first request goes to reps[0]. Health checks
    # every minute unless a test says otherwise: the requests themselves must meet the failure.
    config = {"policy": "round-robin", "health_interval_s": 60.0, **config}
    return ServerThread(create_router_app(RouterConfig([r.url for r in reps], **config)))


def stream_in_thread(url: str, out: dict[str, Any], on_first: Any = None) -> threading.Thread:
    """POST a streamed chat in a thread; ``out`` gets the status, replica header and data lines."""

    def run() -> None:
        with (
            httpx.Client(base_url=url, timeout=60) as c,
            c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
        ):
            out["status"], out["replica"], out["lines"] = (
                r.status_code,
                r.headers.get("x-prefixcache-replica"),
                [],
            )
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out["lines"].append(line)
                    if len(out["lines"]) == 1 and on_first is not None:
                        on_first()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_stream_whose_replica_dies_before_the_first_byte_is_retried_whole(fake_replicas) -> None:  # noqa: ANN001
    r0, r1 = fake_replicas(2, modes=["hold-before-body"])
    with router([r0, r1]) as srv:
        out: dict[str, Any] = {}
        t = stream_in_thread(srv.url, out)
        wait_until(lambda: len(r0.stats()["served"]) == 1, "the request to reach r0")
        r0.kill()  # headers sent, no event: nothing went to the client yet
        t.join(60)
        snap = snapshot(srv.url)
    assert out["status"] == 200 and out["replica"] == r1.url
    assert out["lines"][:2] == FULL_STREAM and out["lines"][-1] == "data: [DONE]" and len(out["lines"]) == 4
    assert len(r1.stats()["served"]) == 1
    assert snap["failovers"] == 1
    row0 = replica_row(snap, r0)
    assert (row0["healthy"], row0["connect_failures"], row0["broken_streams"]) == (False, 1, 0)
    assert replica_row(snap, r1)["completed"] == 1


def test_a_stream_whose_replica_dies_mid_answer_is_ended_with_an_error_and_counted(fake_replicas) -> None:  # noqa: ANN001
    r0, r1 = fake_replicas(2, modes=["hold-mid-stream"])
    with router([r0, r1]) as srv:
        out: dict[str, Any] = {}
        t = stream_in_thread(srv.url, out, on_first=r0.kill)  # the first event reached the client
        t.join(60)
        assert not t.is_alive()
        snap = snapshot(srv.url)
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert out["status"] == 200 and out["replica"] == r0.url
    assert out["lines"][0] == FULL_STREAM[0] and len(out["lines"]) == 2  # no splice, no [DONE]
    error = json.loads(out["lines"][1][5:])["error"]
    assert error["code"] == "stream_broken" and error["type"] == "server_error"
    assert "incomplete" in error["message"]
    assert r1.stats()["served"] == []  # not retried
    assert snap["failovers"] == 0
    row0 = replica_row(snap, r0)
    assert (row0["healthy"], row0["broken_streams"], row0["failed"]) == (False, 1, 1)
    assert f'prefixcache_router_broken_streams_total{{replica="{r0.url}"}} 1.0' in metrics
    assert f'prefixcache_router_broken_streams_total{{replica="{r1.url}"}} 0.0' in metrics


def test_a_client_leaving_mid_stream_closes_the_upstream_and_is_not_a_replica_failure(fake_replicas) -> None:  # noqa: ANN001
    (r0,) = fake_replicas(1, modes=["hold-mid-stream"])  # the replica would never end this stream
    with router([r0]) as srv:
        with (
            httpx.Client(base_url=srv.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r,
        ):
            assert next(line for line in r.iter_lines() if line.startswith("data:")) == FULL_STREAM[0]
        # The client is gone: the relay stops and is booked once, as completed.
        wait_until(lambda: replica_row(snapshot(srv.url), r0)["in_flight"] == 0, "the relay to close")
        row = replica_row(snapshot(srv.url), r0)
    assert (row["completed"], row["failed"], row["broken_streams"], row["healthy"]) == (1, 0, 0, True)


def test_the_openai_client_raises_on_a_broken_stream(fake_replicas) -> None:  # noqa: ANN001
    import openai

    (r0,) = fake_replicas(1, modes=["hold-mid-stream"])
    with router([r0]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        first = next(iter(stream))
        assert first.choices[0].delta.content == "hello"
        r0.kill()
        with pytest.raises(openai.APIError, match="incomplete"):
            for _ in stream:
                pass


def test_a_request_is_tried_on_two_replicas_at_most(fake_replicas) -> None:  # noqa: ANN001
    r0, r1, r2 = fake_replicas(3, modes=["hold-before-body", "hold-before-body"])
    with router([r0, r1, r2]) as srv:
        out: dict[str, Any] = {}
        t = stream_in_thread(srv.url, out)
        wait_until(lambda: len(r0.stats()["served"]) == 1, "the request to reach r0")
        r0.kill()
        wait_until(lambda: len(r1.stats()["served"]) == 1, "the retry to reach r1")
        r1.kill()
        t.join(60)
        snap = snapshot(srv.url)
    assert out["status"] == 503 and out["replica"] is None and out["lines"] == []
    assert r2.stats()["served"] == []  # a third replica is never tried
    assert snap["failovers"] == 1
    assert [x["connect_failures"] for x in snap["replicas"]] == [1, 1, 0]


def test_a_slow_replica_times_out_without_being_marked_down_or_retried(fake_replicas) -> None:  # noqa: ANN001
    r0, r1 = fake_replicas(2, delay_s=[30.0, 0.0])
    with (
        router([r0, r1], read_timeout_s=0.5, health_interval_s=0.1) as srv,
        httpx.Client(base_url=srv.url) as c,
    ):
        slow = c.post("/v1/chat/completions", json=CHAT, timeout=30)
        assert slow.status_code == 504 and slow.json()["error"]["code"] == "replica_timeout"
        assert "--read-timeout" in slow.json()["error"]["message"]
        assert r1.stats()["served"] == []  # not retried elsewhere
        fast = c.post("/v1/chat/completions", json=CHAT, timeout=30)
        assert fast.status_code == 200 and fast.headers["x-prefixcache-replica"] == r1.url
        again = c.post("/v1/chat/completions", json=CHAT, timeout=30)  # r0 is still in rotation
        assert again.status_code == 504
        snap = c.get("/router/replicas").json()
        anth = c.post("/v1/messages", json={**CHAT, "max_tokens": 4, "stream": True}, timeout=30)
    row0 = replica_row(snap, r0)
    assert (row0["healthy"], row0["timeouts"], row0["connect_failures"]) == (True, 2, 0)
    assert snap["failovers"] == 0 and len(r0.stats()["served"]) == 2
    assert anth.status_code == 200 and anth.headers["x-prefixcache-replica"] == r1.url


def test_a_replica_marked_down_returns_when_its_health_check_passes(fake_replicas) -> None:  # noqa: ANN001
    r0, r1 = fake_replicas(2)
    with router([r0, r1], health_interval_s=0.1) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r0.kill()
        first = c.post("/v1/chat/completions", json=CHAT)  # r0 refuses: retried on r1
        assert first.status_code == 200 and first.headers["x-prefixcache-replica"] == r1.url
        assert replica_row(c.get("/router/replicas").json(), r0)["healthy"] is False
        (back,) = fake_replicas(1, port=r0.port)  # a new process where the router expects r0
        wait_until(lambda: replica_row(c.get("/router/replicas").json(), r0)["healthy"], "r0 to be healthy")
        where = {c.post("/v1/chat/completions", json=CHAT).headers["x-prefixcache-replica"] for _ in range(2)}
        assert c.get("/health").json() == {"status": "ok", "healthy_replicas": 2, "replicas": 2}
    assert where == {r0.url, r1.url}
    assert len(back.stats()["served"]) == 1


# ---------------------------------------------------------------------------- bodies
def test_bodies_over_the_limit_too_deep_or_not_unicode_never_reach_a_replica(fake_replicas) -> None:  # noqa: ANN001
    (r0,) = fake_replicas(1)
    with router([r0], max_body_bytes=4096) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "4096 bytes (--max-body-bytes)" in r.json()["error"]["message"]
        r = c.post("/v1/messages", json=big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

        def chunked() -> Any:  # no Content-Length: counted as it arrives
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}]}'

        r = c.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        deep = b'{"model": "m", "messages": ' + b"[" * 1500 + b"]" * 1500 + b"}"
        r = c.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_deep"
        assert "1501 levels deep; at most 64" in r.json()["error"]["message"]

        lone = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        r = c.post("/v1/messages", content=lone, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "'messages[0].content' is not valid text" in r.json()["error"]["message"]

        ok = c.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "😀"}]})
        assert ok.status_code == 200  # a valid surrogate pair is fine
    assert len(r0.stats()["served"]) == 1
