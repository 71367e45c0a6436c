"""The router: prefix keys, policies, and the proxy in front of fake replica processes."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.router import Policy, Router, RouterConfig, create_router_app, prefix_key, usage_from
from prefixcache.router.proxy import SSEUsage

from .conftest import ServerThread

SYSTEMS = {t: f"You are the assistant of tenant {t}. " + f"Policy text {t}. " * 60 for t in "ABCD"}


def chat(tenant: str, i: int, **extra: object) -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEMS[tenant]},
            {"role": "user", "content": f"question {i}"},
        ],
        "user": f"{tenant}-{i}",
        **extra,
    }


# ---------------------------------------------------------------------------- keys and policies
def test_prefix_key_follows_the_shared_prefix_and_the_tenant() -> None:
    a1, a2 = prefix_key(chat("A", 1), "Bearer ka"), prefix_key(chat("A", 2), "Bearer ka")
    assert a1.affinity == a2.affinity and a1.chunks[:-1] == a2.chunks[:-1]
    assert prefix_key(chat("B", 1), "Bearer ka").affinity != a1.affinity
    assert prefix_key(chat("A", 1), "Bearer kb").affinity != a1.affinity  # tenants never share
    k1 = prefix_key({**chat("A", 1), "prompt_cache_key": "conv-7"}, "Bearer ka")
    k2 = prefix_key({**chat("B", 9), "prompt_cache_key": "conv-7"}, "Bearer ka")
    assert k1.explicit and k1.affinity == k2.affinity
    anth = {
        "model": "m",
        "system": SYSTEMS["A"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
    }
    assert prefix_key(anth, "ka").affinity == prefix_key({**anth, "messages": []}, "ka").affinity
    assert prefix_key({"not": "chat"}).chunks  # odd bodies still route


def test_policies_order_and_the_load_guard() -> None:
    urls = ["http://a", "http://b", "http://c"]
    rr = Router(urls, Policy.ROUND_ROBIN)
    key = prefix_key(chat("A", 0))
    assert [rr.candidates(key)[0].url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]

    aff = Router(urls, Policy.PREFIX_AFFINITY, load_factor=2.0, load_slack=4)
    firsts = {aff.candidates(prefix_key(chat("A", i)))[0].url for i in range(10)}
    assert len(firsts) == 1
    home = aff.by_url(firsts.pop())
    assert home is not None
    home.in_flight = 5  # 5 > 2 * 0 + 4: too far ahead
    assert aff.candidates(key)[0] is not home and aff.load_fallbacks == 1
    home.in_flight = 4
    assert aff.candidates(key)[0] is home

    # When a replica dies, only its keys move (rendezvous hashing).
    keys = [prefix_key(chat(t, 0), f"k{j}") for t in "ABCD" for j in range(5)]
    before = {k.affinity: aff.candidates(k)[0].url for k in keys}
    home.in_flight = 0
    aff.by_url("http://b").healthy = False  # type: ignore[union-attr]
    after = {k.affinity: aff.candidates(k)[0].url for k in keys}
    moved = [a for a in before if before[a] != after[a]]
    assert all(before[a] == "http://b" for a in moved)

    ca = Router(urls, Policy.CACHE_AWARE)
    k = prefix_key(chat("A", 1))
    ca.started(ca.by_url("http://c"), k)  # type: ignore[arg-type]
    ca.finished(ca.by_url("http://c"), ok=True)  # type: ignore[arg-type]
    assert ca.candidates(prefix_key(chat("A", 2)))[0].url == "http://c"  # longest recorded prefix


def test_usage_parsing_openai_anthropic_and_streams() -> None:
    assert usage_from({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}}) == (
        10,
        8,
    )
    assert usage_from(
        {"usage": {"input_tokens": 2, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 4}}
    ) == (14, 8)
    s = SSEUsage()
    usage = {"input_tokens": 3, "cache_read_input_tokens": 16}
    start = {"type": "message_start", "message": {"usage": usage}}
    event = b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"
    for i in range(0, len(event), 7):  # split anywhere
        s.feed(event[i : i + 7])
    assert s.usage == (19, 16)


def test_usage_parsing_of_the_responses_api_whole_and_streamed() -> None:
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 5}
    assert usage_from({"object": "response", "usage": usage}) == (40, 32)
    s = SSEUsage()
    done = {"type": "response.completed", "response": {"status": "completed", "usage": usage}}
    s.feed(b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n")
    assert s.usage == (40, 32)


def test_responses_requests_are_keyed_by_instructions_and_input() -> None:
    def responses(system: str, user: str) -> dict:
        # Affinity reads the first 1,024 characters; only full 256-character chunks are keyed.
        return {
            "model": "m",
            "instructions": system * 2000,
            "input": [{"role": "user", "content": user * 100}],
        }

    a1, a2 = prefix_key(responses("A", "one")), prefix_key(responses("A", "two"))
    assert a1.affinity == a2.affinity and a1.chunks != a2.chunks  # shared instructions, own tails
    assert prefix_key(responses("B", "one")).affinity != a1.affinity
    plain = prefix_key({"model": "m", "input": "hello" * 100})
    assert plain.chunks != prefix_key({"model": "m", "input": "hullo" * 100}).chunks


# ---------------------------------------------------------------------------- the proxy
@pytest.mark.parametrize("policy", ["cache-aware", "prefix-affinity"])
def test_requests_sharing_a_prefix_land_on_one_replica(fake_replicas, policy: str) -> None:  # noqa: ANN001
    reps = fake_replicas(3)
    app = create_router_app(RouterConfig([r.url for r in reps], policy=policy))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        placed: dict[str, set[str]] = {t: set() for t in "ABCD"}
        for i in range(5):
            for t in "ABCD":
                r = c.post(
                    "/v1/chat/completions", json=chat(t, i), headers={"authorization": f"Bearer key-{t}"}
                )
                assert r.status_code == 200, r.text
                placed[t].add(r.json()["replica"])
        assert all(len(v) == 1 for v in placed.values()), placed
        # Anthropic shape, streamed, through the same router.
        body = {
            "model": "m",
            "system": SYSTEMS["A"],
            "stream": True,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "q"}],
        }
        with c.stream("POST", "/v1/messages", json=body, headers={"x-api-key": "key-A"}) as r:
            assert r.status_code == 200 and "text/event-stream" in r.headers["content-type"]
            text = "".join(r.iter_text())
        assert "message_start" in text and "message_stop" in text
        # OpenAI streamed: relayed event by event, usage read on the way.
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json=chat("B", 9, stream=True),
            headers={"authorization": "Bearer key-B"},
        ) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 4
        snap = c.get("/router/replicas").json()["replicas"]
        assert sum(r["completed"] for r in snap) == 22 and sum(r["failed"] for r in snap) == 0
        assert sum(r["cached_tokens"] for r in snap) > 0
        metrics = c.get("/metrics").text
        assert 'prefixcache_router_requests_total{replica="' in metrics
        assert "prefixcache_router_hit_rate_total" in metrics
    # Each tenant's prompts hit on its replica after the first one.
    hits = [s["cached"] > 0 for r in reps for s in r.stats()["served"]]
    assert sum(hits) >= 4 * 4


def test_round_robin_scatters_a_shared_prefix(fake_replicas) -> None:  # noqa: ANN001
    reps = fake_replicas(3)
    app = create_router_app(RouterConfig([r.url for r in reps], policy="round-robin"))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        where = [c.post("/v1/chat/completions", json=chat("A", i)).json()["replica"] for i in range(6)]
    assert Counter(where) == {"r0": 2, "r1": 2, "r2": 2}


def test_killed_replica_fails_over_with_no_failed_request(fake_replicas) -> None:  # noqa: ANN001
    reps = fake_replicas(3, delay_s=0.05)
    # Health checks only at start: the requests themselves must find the dead replica (with
    # frequent checks a check could mark it down before any request tried it).
    app = create_router_app(RouterConfig([r.url for r in reps], policy="cache-aware", health_interval_s=60))
    statuses: list[int] = []
    lock = threading.Lock()
    killed = threading.Event()

    with ServerThread(app) as srv:

        def client_loop(worker: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                for i in range(12):
                    r = c.post(
                        "/v1/chat/completions",
                        json=chat("ABCD"[(worker + i) % 4], i),
                        headers={"authorization": f"Bearer w{worker}"},
                    )
                    with lock:
                        statuses.append(r.status_code)
                    if worker == 0 and i == 3:
                        victim = next(x for x in reps if x.name == r.json()["replica"])
                        victim.kill()  # SIGKILL while the other workers' requests are in flight
                        killed.set()

        threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert killed.is_set()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            snap = c.get("/router/replicas").json()
            health = c.get("/health").json()
    # Non-streamed requests are retried even when the replica died under them: none failed.
    assert statuses == [200] * 48, Counter(statuses)
    down = [r for r in snap["replicas"] if not r["healthy"]]
    assert len(down) == 1 and down[0]["connect_failures"] >= 1
    assert health == {"status": "ok", "healthy_replicas": 2, "replicas": 3}


def test_all_replicas_down_is_a_clear_503(fake_replicas) -> None:  # noqa: ANN001
    reps = fake_replicas(1)
    reps[0].kill()
    app = create_router_app(RouterConfig([reps[0].url], health_interval_s=60))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert "No replica" in r.json()["error"]["message"]


def test_keep_warm_policy_pins_on_every_replica(fake_replicas, tmp_path: Path) -> None:  # noqa: ANN001
    reps = fake_replicas(2)
    policy = tmp_path / "warm.json"
    policy.write_text(
        json.dumps(
            {
                "interval_s": 3600,
                "prefixes": [
                    {
                        "name": "support",
                        "api_key": "key-A",
                        "messages": [{"role": "system", "content": SYSTEMS["A"]}],
                    },
                    {"name": "raw", "prompt": "shared preamble"},
                ],
            }
        )
    )
    policy.chmod(0o600)  # it holds API keys: readable by its owner only
    app = create_router_app(RouterConfig([r.url for r in reps], keepwarm_file=str(policy)))
    with ServerThread(app) as srv:
        from .conftest import wait_http

        wait_http(srv.url + "/health")
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(len(r.stats()["pins"]) == 2 for r in reps):
            time.sleep(0.05)
        with httpx.Client(base_url=srv.url, timeout=30) as c:  # and ad hoc, through the API
            r = c.post("/v1/cache/pin", json={"prompt": "another"}, headers={"authorization": "Bearer key-B"})
            assert r.status_code == 200 and len(r.json()["replicas"]) == 2
    for rep in reps:
        pins = rep.stats()["pins"]
        assert [p["body"] for p in pins[:2]] == [
            {"messages": [{"role": "system", "content": SYSTEMS["A"]}]},
            {"prompt": "shared preamble"},
        ]
        assert pins[0]["auth"] == "Bearer key-A" and pins[2]["auth"] == "Bearer key-B"


def test_route_command_serves_and_stops(fake_replicas) -> None:  # noqa: ANN001
    import subprocess
    import sys

    from .conftest import free_port, wait_http

    reps = fake_replicas(2)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "prefixcache",
        "route",
        "--policy",
        "prefix-affinity",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-body-bytes",
        "2KiB",
    ]
    for r in reps:
        cmd += ["--replica", r.url]
    proc = subprocess.Popen(cmd)
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat("A", 0), timeout=30)
        assert r.status_code == 200 and r.headers["x-prefixcache-replica"] in {x.url for x in reps}
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 2048}]}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 413 and "limit of 2048 bytes" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        assert proc.wait(20) == 0  # a clean stop: uvicorn's re-raised SIGTERM ends as Ctrl-C does


def test_route_command_rejects_an_unknown_policy() -> None:
    from typer.testing import CliRunner

    from prefixcache.cli import app

    res = CliRunner().invoke(app, ["route", "--replica", "http://x", "--policy", "fastest"])
    assert res.exit_code != 0 and "is not a policy" in res.output


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_FIELDS = [
    "model",
    "messages",
    "system",
    "tools",
    "instructions",
    "input",
    "prompt",
    "metadata",
    "prompt_cache_key",
]


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=4))
def test_prefix_key_never_raises_on_any_json_body(body: dict) -> None:
    """The routing key is computed before the replica validates the body: any JSON object must
    give a key (the replica's 400 then says what is wrong), never an exception (a 500)."""
    key = prefix_key(body, "cred")
    assert key.chunks and key.affinity
