"""Fair admission (issue 11, item 4): one tenant cannot take every queue slot. With two tenants
or more, a tenant holds at most ``tenant_queue_share`` of ``max_queue``; beyond it its own
requests get a 429 ``tenant_queue_full`` while the other tenants are still admitted."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from server_helpers import Gated, wait_until

from prefixcache.server.bridge import Admission

MODEL = "test-model"
KEYS = {"sk-a": "alpha", "sk-b": "beta"}
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


def _chat(url: str, key: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={**CHAT, **extra},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_a_flooding_tenant_cannot_take_the_other_tenants_slots(serve, make_engine):
    engine = Gated(make_engine())  # every generation waits at the gate until `release`
    server = serve(engine, model_name=MODEL, api_keys=KEYS, max_queue=4, tenant_queue_share=0.5)
    admission = server.state.bridge.admission
    results: list[int] = []
    flood = [
        threading.Thread(target=lambda: results.append(_chat(server.url, "sk-a").status_code))
        for _ in range(2)
    ]
    for t in flood:
        t.start()
    wait_until(lambda: admission.tenant_depth("alpha") == 2, "alpha to hold its two slots")
    try:
        # alpha's share (2 of 4) is taken: its next requests are refused, whole or streamed ...
        r = _chat(server.url, "sk-a")
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "tenant_queue_full" and "alpha" in r.json()["error"]["message"]
        r = _chat(server.url, "sk-a", stream=True)
        assert r.status_code == 429 and r.headers["content-type"].startswith("application/json")
        r = httpx.post(server.url + "/v1/messages", json=CHAT, headers={"x-api-key": "sk-a"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        # ... while beta is still admitted.
        beta = threading.Thread(target=lambda: results.append(_chat(server.url, "sk-b").status_code))
        beta.start()
        wait_until(lambda: admission.tenant_depth("beta") == 1, "beta to be admitted")
        assert admission.depth == 3
    finally:
        engine.release.set()
    for t in [*flood, beta]:
        t.join(60)
    assert sorted(results) == [200, 200, 200]
    assert admission.depth == 0 and admission.tenant_depth("alpha") == 0


def test_one_tenant_may_use_the_whole_queue(serve, make_engine):
    engine = Gated(make_engine())
    server = serve(engine, model_name=MODEL, max_queue=2, tenant_queue_share=0.5)  # no keys: one tenant
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(_chat(server.url, "x").status_code)) for _ in range(2)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: server.state.bridge.admission.depth == 2, "both requests to be admitted")
    r = _chat(server.url, "x")
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "queue_full"  # the server's limit, not a share
    engine.release.set()
    for t in threads:
        t.join(60)
    assert results == [200, 200]


@pytest.mark.parametrize(
    ("max_queue", "share", "tenants", "limit"),
    [(64, 0.5, 2, 32), (4, 0.1, 3, 1), (64, 1.0, 5, None), (64, 0.5, 1, None)],
)
def test_tenant_limit_for(max_queue, share, tenants, limit):
    assert Admission.tenant_limit_for(max_queue, share, tenants) == limit


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        Admission.tenant_limit_for(8, share, 2)
