"""API keys -> tenants: 401 without a key, one tenant's prefix never hits for another, the salt
never leaves the server."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from prefixcache.server.auth import Authenticator, load_api_keys

MODEL = "test-model"
KEYS = {"sk-alpha": "alpha", "sk-alpha-2": "alpha", "sk-beta": "beta"}
SYSTEM = "Shared system prompt that both tenants happen to send, word for word. " * 8


@pytest.fixture
def server(serve, make_engine):
    return serve(make_engine(), model_name=MODEL, api_keys=KEYS, salt_secret="test-secret")


def oa(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def cached(client: openai.OpenAI, user: str) -> int:
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_missing_or_wrong_key_is_401_in_both_shapes(server):
    with pytest.raises(openai.AuthenticationError) as info:
        oa(server, "sk-wrong").models.list()
    assert info.value.body["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as info2:
        anthropic.Anthropic(base_url=server.url, api_key="sk-nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert info2.value.body["type"] == "error"
    assert info2.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_tenant_prefix_never_hits_for_another_tenant(server):
    alpha, alpha2, beta = oa(server, "sk-alpha"), oa(server, "sk-alpha-2"), oa(server, "sk-beta")
    assert cached(alpha, "first") == 0
    assert cached(beta, "first") == 0  # same tokens, other tenant: a miss
    assert cached(alpha2, "second") > 0  # same tenant, other key: a hit
    assert cached(beta, "second") > 0  # beta hits its own copy
    # Anthropic clients authenticate with x-api-key and land in the same tenant.
    msg = anthropic.Anthropic(base_url=server.url, api_key="sk-beta", max_retries=0).messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": "third"}]
    )
    # The same chat renders to the same tokens in both shapes: beta's OpenAI-written prefix hits.
    assert msg.usage.cache_read_input_tokens > 0
    stats = httpx.get(server.url + "/v1/cache", headers={"authorization": "Bearer sk-alpha"}).json()
    assert stats["tenant"] == "alpha" and stats["requests"] == 2 and stats["hit_tokens"] > 0


def test_salt_is_never_returned(server):
    salt = server.state.auth.salt_for("alpha")
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"authorization": "Bearer sk-alpha"},
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    stats = httpx.get(server.url + "/v1/cache", headers={"x-api-key": "sk-alpha"})
    for body in (r.text, stats.text):
        assert salt.hex() not in body and "salt" not in body


def test_flush_removes_only_the_callers_blocks(server):
    cached(oa(server, "sk-alpha"), "a")
    cached(oa(server, "sk-beta"), "b")
    r = httpx.delete(server.url + "/v1/cache", headers={"authorization": "Bearer sk-alpha"})
    assert r.status_code == 200 and r.json()["flushed_blocks"] > 0
    assert cached(oa(server, "sk-alpha"), "a") == 0
    assert cached(oa(server, "sk-beta"), "b") > 0


def test_pin_keeps_a_prefix_warm(serve, make_engine):
    from prefixcache.cache import FakeClock

    clock = FakeClock()
    server = serve(make_engine(clock=clock), model_name=MODEL)
    body = {"messages": [{"role": "system", "content": SYSTEM}]}
    r = httpx.post(server.url + "/v1/cache/pin", json=body)
    assert r.status_code == 200 and r.json()["pinned_tokens"] >= 16 * (len(SYSTEM) // 16 - 1)
    clock.advance(3 * 3600)
    client = oa(server, "unused")
    assert cached(client, "after hours") >= r.json()["pinned_tokens"] - 16
    r = httpx.request("DELETE", server.url + "/v1/cache/pin", json=body)
    assert r.json()["unpinned_tokens"] > 0
    server.engine.cache.check_integrity()


def test_key_file_formats(tmp_path):
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"k1": "t1", "k2": "t2"}))
    lines = tmp_path / "keys.txt"
    lines.write_text("# comment\nk1: t1\n\nk2 : t2\n")
    assert load_api_keys(j) == load_api_keys(lines) == {"k1": "t1", "k2": "t2"}
    bad = tmp_path / "bad.txt"
    bad.write_text("no separator here\n")
    with pytest.raises(ValueError, match="key: tenant"):
        load_api_keys(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing")


def test_salt_is_stable_for_a_shared_secret_and_distinct_per_tenant(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_SALT_SECRET", "shared")
    a, b = Authenticator({"k": "t"}), Authenticator({"k": "t"})
    assert a.salt_for("t") == b.salt_for("t") != a.salt_for("u")
    monkeypatch.delenv("PREFIXCACHE_SALT_SECRET")
    assert Authenticator({"k": "t"}).salt_for("t") != Authenticator({"k": "t"}).salt_for("t")
