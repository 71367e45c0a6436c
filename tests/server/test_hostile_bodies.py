"""Hostile bodies (issue 21, item 1): the JSON structure scan is linear for every input (the
unterminated string of escaped quotes that made the old string regex quadratic), the API key is
checked before one byte of the body is read (server and router, every non-public route), the
structure is capped before parsing and validation, and ``/health`` answers while hostile bodies
arrive."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

import httpx
import pytest

from prefixcache.keygate import PUBLIC_PATHS
from prefixcache.limits import MAX_JSON_CONTAINERS, json_shape, parse_json_body
from prefixcache.router import RouterConfig, create_router_app
from prefixcache.server import create_app

KEYS = {"sk-alpha-0123456789": "alpha"}
AUTH = {"authorization": "Bearer sk-alpha-0123456789", "content-type": "application/json"}
#: 65 brackets (past the old pre-check) and an unterminated string of escaped quotes: 1 MiB.
ESCAPED_QUOTES = b"[" * 65 + b'"' + b'\\"' * (1 << 19)


def _reference_depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_reference_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_reference_depth(v) for v in value.values()), default=0)
    return 0


def _random_value(rng: random.Random, depth: int) -> Any:
    r = rng.random()
    if depth > 6 or r < 0.3:  # strings full of what a scanner could mistake for structure
        return "".join(rng.choice('[]{}"\\,ab') for _ in range(rng.randint(0, 6)))
    if r < 0.6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_random_value(rng, 7): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_the_scan_counts_exactly_what_json_holds(monkeypatch):
    import prefixcache.limits as limits

    rng = random.Random(21)
    for n in range(2_000):
        value = _random_value(rng, 0)
        raw = json.dumps(value).encode()
        # Slices of 1, 2, 3, 7 bytes: every escape run and string crosses a slice boundary somewhere.
        monkeypatch.setattr(limits, "_SCAN_SLICE", (1, 2, 3, 7, 1 << 20)[n % 5])
        shape = json_shape(raw)
        assert shape.depth == _reference_depth(value), raw
        assert shape.containers == raw.count(b"[") + raw.count(b"{") - _in_strings(value, "[{"), raw


def _in_strings(value: Any, chars: str) -> int:
    if isinstance(value, str):
        return sum(value.count(c) for c in chars)
    if isinstance(value, list):
        return sum(_in_strings(v, chars) for v in value)
    if isinstance(value, dict):
        return sum(_in_strings(k, chars) + _in_strings(v, chars) for k, v in value.items())
    return 0


@pytest.mark.parametrize(
    "raw",
    [
        ESCAPED_QUOTES,
        b"[" * 65 + b'"' + b"\\" * (1 << 20),
        b'{"a":' * 65 + b'"' + b'\\\\"[' * (1 << 18),
        b'["' + b'"' * (1 << 20),
    ],
    ids=["escaped-quotes", "backslashes", "escape-runs-and-brackets", "quotes"],
)
def test_a_1_mib_hostile_body_is_scanned_in_linear_time(raw):
    start = time.perf_counter()
    with pytest.raises((ValueError, Exception)):
        parse_json_body(raw)
    took = time.perf_counter() - start
    assert took < 2.0, f"{len(raw)} hostile bytes took {took:.2f} s"  # the old regex: hours


def test_structure_over_the_caps_is_refused_before_parsing():
    from prefixcache.limits import RejectedBody

    many = b'{"messages":[' + b"{}," * 400_000 + b"{}]}"
    with pytest.raises(RejectedBody) as e:
        parse_json_body(many)
    assert e.value.status_code == 400 and e.value.code == "too_many_items"
    assert str(MAX_JSON_CONTAINERS) in str(e.value.detail)
    ints = b'{"prompt":[' + b"1," * 300_000 + b"1]}"
    with pytest.raises(RejectedBody) as e:
        parse_json_body(ints)
    assert e.value.code == "too_many_items"
    assert parse_json_body(ints, max_items=400_000)["prompt"][-1] == 1


# ---------------------------------------------------------------------- the key before the body
class _Recorder:
    """An ASGI receive/send pair that records whether the body was asked for."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.reads = 0
        self.status: int | None = None
        self.response = b""

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.response += message.get("body", b"")


async def _call(app: Any, method: str, path: str, headers: dict[str, str], body: bytes) -> _Recorder:
    rec = _Recorder(body)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    await app(scope, rec.receive, rec.send)
    return rec


def _gated_paths() -> list[tuple[str, str]]:
    from prefixcache.server.anthropic import routes as routes_anthropic
    from prefixcache.server.openai import responses as routes_responses
    from prefixcache.server.openai import routes as routes_openai
    from prefixcache.server.ops import routes as routes_ops
    from prefixcache.server.ops import routes_dashboard

    out = []
    modules = (routes_openai, routes_responses, routes_anthropic, routes_ops, routes_dashboard)
    for route in [r for m in modules for r in m.router.routes]:
        path = str(getattr(route, "path", ""))
        if path in PUBLIC_PATHS or path.startswith("/dashboard/") or "{" in path:
            continue
        out += [(m, path) for m in sorted(getattr(route, "methods", None) or ())]
    return [*out, ("POST", "/v1/route-added-later")]


def test_the_server_checks_the_key_before_reading_the_body(make_engine):
    asyncio.run(_server_gate(create_app(make_engine(), api_keys=KEYS, model_name="test-model")))


async def _server_gate(app: Any) -> None:
    body = b'{"messages":[' + b"{}," * 100_000 + b"{}]}"
    paths = _gated_paths()
    assert ("POST", "/v1/chat/completions") in paths and ("DELETE", "/v1/cache") in paths
    for method, path in paths:
        for headers, code in (({}, "missing_api_key"), ({"x-api-key": "sk-wrong-key"}, "invalid_api_key")):
            rec = await _call(app, method, path, headers, body)
            assert rec.status == 401, (method, path, rec.response[:200])
            assert rec.reads == 0, f"{method} {path} read the body of an unauthenticated request"
            assert code.encode() in rec.response or path.startswith("/v1/messages")
    ok = await _call(app, "POST", "/v1/chat/completions", AUTH, body)
    assert ok.reads >= 1 and ok.status == 400 and b"too_many_items" in ok.response


def test_the_router_checks_its_keys_before_reading_the_body():
    config = RouterConfig(replicas=["http://127.0.0.1:9"], api_keys=frozenset(KEYS))
    asyncio.run(_router_gate(create_router_app(config)))


async def _router_gate(app: Any) -> None:
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/cache/pin"),
        ("GET", "/router/replicas"),
        ("GET", "/router/dashboard"),
        ("POST", "/tokenize"),
    ]:
        rec = await _call(app, method, path, {}, ESCAPED_QUOTES)
        assert rec.status == 401 and rec.reads == 0, (method, path, rec.response[:200])
    rec = await _call(app, "GET", "/health", {}, b"")
    assert rec.status in (200, 503)  # public (503: no replica answered a health check yet)


# ---------------------------------------------------------------------- a live server meanwhile
def test_health_answers_while_1_mib_hostile_bodies_arrive(serve, make_engine):
    server = serve(make_engine(), api_keys=KEYS, model_name="test-model")
    worst = 0.0
    stop = threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                start = time.perf_counter()
                assert client.get(server.url + "/health").status_code == 200
                worst = max(worst, time.perf_counter() - start)
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/completions"):
            start = time.perf_counter()
            r = httpx.post(server.url + path, content=ESCAPED_QUOTES, headers=AUTH, timeout=30)
            took = time.perf_counter() - start
            assert r.status_code == 400 and "nests JSON 65 levels deep" in r.text, r.text[:300]
            assert took < 2.0, f"{path}: a 1 MiB hostile body took {took:.2f} s"
            r = httpx.post(
                server.url + path,
                content=ESCAPED_QUOTES,
                headers={"content-type": "application/json"},
                timeout=30,
            )  # no key
            assert r.status_code == 401
    finally:
        stop.set()
        poller.join(timeout=10)
    assert worst < 1.0, f"/health took {worst:.3f} s while hostile bodies arrived"
