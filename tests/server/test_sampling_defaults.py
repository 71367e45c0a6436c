"""The APIs' sampling defaults have one home (``server/generation.py``): every generation route
and every vLLM render route that gets no ``temperature`` or ``top_p`` uses the values there."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers import Scripted

from prefixcache.server import generation

MODEL = "test-model"
USER = [{"role": "user", "content": "defaults"}]
GENERATIONS = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "defaults", "max_tokens": 1}),
    ("/v1/messages", {"messages": USER, "max_tokens": 1}),
    ("/v1/responses", {"input": "defaults", "max_output_tokens": 1}),
]
RENDERS = [
    ("/v1/chat/completions/render", {"messages": USER, "max_tokens": 1}),
    ("/v1/completions/render", {"prompt": "defaults", "max_tokens": 1}),
    ("/v1/messages/render", {"messages": USER, "max_tokens": 1}),
    ("/v1/responses/render", {"input": "defaults", "max_output_tokens": 1}),
]


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    """Other values in the one home (any the schemas accept)."""
    monkeypatch.setattr(generation, "API_TEMPERATURE", 0.25)
    monkeypatch.setattr(generation, "API_TOP_P", 0.75)
    return 0.25, 0.75


@pytest.fixture
def server(serve: Any, make_engine: Any) -> Any:
    return serve(Scripted(make_engine(), reply=None), model_name=MODEL)


@pytest.mark.parametrize(("path", "body"), GENERATIONS, ids=[p for p, _ in GENERATIONS])
def test_a_generation_without_sampling_fields_gets_the_defaults(server, moved, path, body) -> None:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    asked = server.engine.requests[-1]
    assert (asked["temperature"], asked["top_p"]) == moved


@pytest.mark.parametrize(("path", "body"), RENDERS, ids=[p for p, _ in RENDERS])
def test_a_render_without_sampling_fields_shows_the_defaults(server, moved, path, body) -> None:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    params = (out[0] if isinstance(out, list) else out)["sampling_params"]
    assert (params["temperature"], params["top_p"]) == moved
