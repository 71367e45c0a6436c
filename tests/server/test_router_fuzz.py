"""Fuzzing the router in front of a live replica: the same generators and the same rule as the
server's fuzz test (``fuzz_checks.check_answer``): every answer is a 2xx or a 4xx in the called
API's error shape with a message, never a 5xx or an exception past the handlers, whether the
router refuses the body itself (size, nesting, surrogates) or relays the replica's answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from fuzz_checks import FUZZ, RERUN, SEED, ErrorLog, check_answer, collecting_errors
from fuzz_strategies import BODIES, RAW_BODIES, encode
from hypothesis import given, seed
from hypothesis import strategies as st
from server_helpers import RunningServer

from prefixcache.router import RouterConfig, create_router_app
from prefixcache.server import create_app

MODEL = "test-model"
#: The router's own routes and proxied ones without a body.
ROUTER_BODILESS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/router/replicas"),
    ("GET", "/router/dashboard"),
    ("GET", "/v1/models"),
    ("GET", "/v1/nowhere"),
]


@pytest.fixture(scope="module")
def routed(tiny_runner: Any) -> Iterator[RunningServer]:
    import torch

    from prefixcache.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest.make_engine
    engine = Engine(tiny_runner, prefill_chunk=16)
    replica = RunningServer(create_app(engine, model_name=MODEL, max_queue=8), engine).start()
    config = RouterConfig([replica.url], policy="cache-aware", health_interval_s=60, max_body_bytes=1 << 20)
    router = RunningServer(create_router_app(config), None).start()
    print(RERUN)
    yield router
    router.stop()
    replica.stop()
    engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def error_log(routed: RunningServer) -> Iterator[ErrorLog]:
    with collecting_errors("prefixcache", "uvicorn.error") as handler:
        yield handler


def test_the_fuzzers_reach_every_route_of_the_router():
    """The router's own routes are fuzzed (the replicas' routes reach it through its catch-all,
    and are the server's: ``BODIES``)."""
    app = create_router_app(RouterConfig(["http://127.0.0.1:9"]))
    own = {
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema and "{path" not in route.path
        for method in route.methods
    }
    assert sorted(own - set(BODIES) - set(ROUTER_BODILESS)) == []


@pytest.mark.parametrize(("method", "path"), list(BODIES), ids=[f"{m} {p}" for m, p in BODIES])
@FUZZ
@seed(SEED)
@given(data=st.data())
def test_router_answers_edge_case_bodies(routed, error_log, method, path, data):
    body = encode(data.draw(BODIES[(method, path)], label="body"))
    r = httpx.request(
        method, routed.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
    )
    check_answer(method, path, r, error_log)


@pytest.mark.parametrize(("method", "path"), list(BODIES), ids=[f"{m} {p}" for m, p in BODIES])
@FUZZ
@seed(SEED)
@given(raw=RAW_BODIES)
def test_router_answers_raw_bodies(routed, error_log, method, path, raw):
    r = httpx.request(
        method, routed.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    check_answer(method, path, r, error_log)


@pytest.mark.parametrize(("method", "path"), ROUTER_BODILESS, ids=[f"{m} {p}" for m, p in ROUTER_BODILESS])
@FUZZ
@seed(SEED)
@given(raw=RAW_BODIES, query=st.dictionaries(st.text(max_size=20), st.text(max_size=100), max_size=2))
def test_router_bodiless_routes_answer_junk(routed, error_log, method, path, raw, query):
    params = {
        k.encode("utf-8", "replace").decode(): v.encode("utf-8", "replace").decode() for k, v in query.items()
    }
    r = httpx.request(method, routed.url + path, params=params, content=raw, timeout=60)
    check_answer(method, path, r, error_log)


def test_router_refuses_an_oversized_body_before_reading_it(routed, error_log):
    r = httpx.post(
        routed.url + "/v1/messages",
        content=b'{"model":"test-model","messages":[{"role":"user","content":"' + b"x" * (2 << 20) + b'"}]}',
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert r.json()["type"] == "error" and "bytes" in r.json()["error"]["message"]
    check_answer("POST", "/v1/messages", r, error_log)


def test_a_pin_every_replica_refuses_is_their_4xx_with_their_message(routed, error_log):
    r = httpx.post(routed.url + "/v1/cache/pin", json={}, timeout=60)
    assert r.status_code == 400, r.text
    body = r.json()
    assert "exactly one of 'messages', 'prompt'" in body["error"]["message"]
    assert [reply["status"] for reply in body["replicas"]] == [400]
    check_answer("POST", "/v1/cache/pin", r, error_log)
