"""The API key headers are read without FastAPI ``Header`` parameters (``state.get_tenant``).

FastAPI builds a pydantic adapter for each declared parameter on a route's first request, with
a ``Field(alias=...)`` that pydantic warns about, and hides that warning with
``warnings.catch_warnings``; that is not thread-safe, so two servers answering their first
requests at once (the external-router tests) let "The 'alias' attribute with value
'authorization' was provided to the `Field()` function ..." through. The test takes FastAPI's
hiding away, as another thread's ``catch_warnings`` does when it ends at the wrong moment. (A
route's body parameter is declared, and so still built that way: FastAPI's own matter.)"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic.warnings import UnsupportedFieldAttributeWarning

from prefixcache.server import create_app

KEY = "sk-alpha-0123456789abcdef"


def test_the_key_headers_are_read_without_an_aliased_field(make_engine: Any, monkeypatch: pytest.MonkeyPatch):
    unhidden = types.SimpleNamespace(
        catch_warnings=contextlib.nullcontext, simplefilter=lambda *a, **k: None, warn=warnings.warn
    )
    monkeypatch.setattr("fastapi._compat.v2.warnings", unhidden)
    app = create_app(make_engine(), model_name="test-model", api_keys={KEY: "alpha"})
    with warnings.catch_warnings(record=True) as seen, TestClient(app) as client:
        warnings.simplefilter("always")
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/v1/cache", headers={"x-api-key": KEY}).status_code == 200
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        answer = client.post("/v1/chat/completions", json=body, headers={"X-Api-Key": KEY})
        assert answer.status_code == 200, answer.text
    aliased = [str(w.message) for w in seen if issubclass(w.category, UnsupportedFieldAttributeWarning)]
    assert [m for m in aliased if "'authorization'" in m or "'x-api-key'" in m] == []
