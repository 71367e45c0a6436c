"""Schemathesis fuzzing of every route of the OpenAPI schema against a live server: whatever
the body (valid, invalid, or not JSON at all), the answer is never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from server_helpers import RunningServer

from prefixcache.server import create_app

MODEL = "test-model"

schema = schemathesis.openapi.from_dict(create_app(None, model_name=MODEL).openapi())
schema.config.generation.update(
    modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
    deterministic=True,
    database="none",
)


@pytest.fixture(scope="module")
def live(tiny_runner: Any) -> Iterator[RunningServer]:
    import torch

    from prefixcache.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest.make_engine
    # Fuzzed bodies ask for up to a million tokens; the tiny model's 2,048-token context turns
    # most of those into a 400 at once, and the rest decode fast.
    engine = Engine(tiny_runner, prefill_chunk=16)
    server = RunningServer(create_app(engine, model_name=MODEL, max_queue=8), engine).start()
    yield server
    server.stop()
    engine.close()
    torch.set_num_threads(threads)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, live):
    response = case.call(base_url=live.url, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:  # every error is JSON in the route's shape, with a message
        body = response.json()
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["message"]
        else:
            assert body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize(
    "payload",
    [b"", b"{", b"null", b"[1]", b'"text"', b"\xff\xfe", b'{"model": 1}', b'{"messages": "x"}'],
)
def test_garbage_bodies_are_400(live, path, payload):
    r = httpx.post(live.url + path, content=payload, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"]
    assert message and (body.get("type") == "error") == path.startswith("/v1/messages")
