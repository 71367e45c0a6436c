"""The exactness audit over HTTP: the metric, GET/POST /v1/cache/verify, /health, the ack."""

from __future__ import annotations

from typing import Any

import httpx
import torch
from tests.server.server_helpers import wait_until

MODEL = "tiny"
KEYS = {"ka": "alpha", "kb": "beta", "ko": "ops"}
PROMPT = "The audit recomputes a sampled hit and compares it bit for bit with what was served. " * 2


def _h(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _complete(url: str, key: str, prompt: str = PROMPT) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=_h(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, result: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    line = next(
        x for x in text.splitlines() if x.startswith(f'prefixcache_cache_verified_total{{result="{result}"}}')
    )
    return float(line.split()[-1])


def test_audit_metric_routes_health_and_ack(serve: Any, make_engine: Any) -> None:
    engine = make_engine(verify_rate=1.0)
    server = serve(engine, model_name=MODEL, api_keys=KEYS, salt_secret="x", admin_tenants=["ops"])
    url = server.url
    assert _metric(url, "equal") == 0 and _metric(url, "differ") == 0
    _complete(url, "ka")
    hit = _complete(url, "ka")
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_until(lambda: engine.auditor.counts()["equal"] == 1, "the sampled hit's check")
    assert _metric(url, "equal") == 1
    stats = httpx.get(url + "/v1/cache", headers=_h("ka"), timeout=30).json()
    assert stats["verified"] == {"equal": 1, "differ": 0, "skipped": 0} and stats["verify_degraded"] is False
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"

    # Another tenant's check of the same text reads nothing of alpha's: nothing to compare.
    other = httpx.post(url + "/v1/cache/verify", json={"prompt": PROMPT}, headers=_h("kb"), timeout=60)
    assert other.status_code == 200 and other.json()["result"] == "not_cached"

    # A flipped bit in every cached block (only alpha's are cached): position 5 of block 0.
    for block in list(engine.cache.store):
        bits = engine.pool.data[0, 0, 0, block.payload.index, 5]
        bits.view({2: torch.int16, 4: torch.int32}[bits.element_size()])[0] ^= 1
    r = httpx.post(url + "/v1/cache/verify", json={"prompt": PROMPT}, headers=_h("ka"), timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["result"] == "differ" and out["cached_tokens"] > 0
    assert (out["difference"]["block"], out["difference"]["position"]) == (0, 5)
    assert out["difference"]["tenant"] == "alpha"
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["status"] == "degraded" and "exactness" in health["degraded"][0]
    assert _metric(url, "differ") == 1
    board = httpx.get(url + "/v1/dashboard", headers=_h("ka"), timeout=30).json()
    assert board["verify"]["verified"]["differ"] == 1 and board["verify"]["degraded"] is True

    mine = httpx.get(url + "/v1/cache/verify", headers=_h("ka"), timeout=30).json()
    theirs = httpx.get(url + "/v1/cache/verify", headers=_h("kb"), timeout=30).json()
    admin = httpx.get(url + "/v1/cache/verify", headers=_h("ko"), timeout=30).json()
    assert len(mine["differences"]) == 1 and theirs["differences"] == [] and len(admin["differences"]) == 1
    assert mine["verified"]["differ"] == 1 and mine["degraded"] is True

    refused = httpx.post(url + "/v1/cache/verify/ack", headers=_h("ka"), timeout=30)
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    ack = httpx.post(url + "/v1/cache/verify/ack", headers=_h("ko"), timeout=30)
    assert ack.status_code == 200 and ack.json() == {"acknowledged": 1, "degraded": False}
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"

    # The next request recomputes: nothing of the wrong blocks is read again.
    again = _complete(url, "ka")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == hit["choices"][0]["text"]


def test_verify_rejects_bad_bodies_and_needs_an_audit(serve: Any, make_engine: Any) -> None:
    server = serve(make_engine(), model_name=MODEL)
    bad = httpx.post(
        server.url + "/v1/cache/verify", json={"prompt": PROMPT, "prompt_token_ids": [1]}, timeout=30
    )
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
    empty = httpx.post(server.url + "/v1/cache/verify", json={}, timeout=30)
    assert empty.status_code == 400
    ok = httpx.post(
        server.url + "/v1/cache/verify", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["result"] == "not_cached"
    ack = httpx.post(server.url + "/v1/cache/verify/ack", timeout=30)  # no keys: one operator
    assert ack.status_code == 200 and ack.json() == {"acknowledged": 0, "degraded": False}

    off = serve(make_engine(enable_cache=False), model_name=MODEL)
    r = httpx.post(off.url + "/v1/cache/verify", json={"prompt": PROMPT}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "verify_unavailable"
