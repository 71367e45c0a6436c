"""Another caller's prompt text never reaches a response (issue 21, item 2): two API keys of one
tenant share its cache, and key B replays the recovery attack (each miss reason's
``cached_text`` extends B's guess by 8 tokens: a 60-token secret in 8 requests) and learns
0 bytes; key A still sees its own cached text; the dashboard's previews and the busting report's
examples follow the same rule; the single user of a keyless loopback server sees everything."""

from __future__ import annotations

import json

import httpx
import pytest

from prefixcache.server.caller_text import TextPolicy

MODEL = "test-model"
SECRET = "The launch code for tenant acme is 7731-ORCHID, valid until the end of the quarter."
KEYS = {"sk-writer-0123456789": "acme", "sk-prober-0123456789": "acme", "sk-admin-0123456789": "ops"}
A = {"authorization": "Bearer sk-writer-0123456789"}
B = {"authorization": "Bearer sk-prober-0123456789"}
ADMIN = {"authorization": "Bearer sk-admin-0123456789"}


def complete(server, headers, prompt: str) -> dict:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def recover(server, headers, requests: int = 10) -> tuple[str, list[str]]:
    """The attack: a guess that leaves the secret at its first token, extended by whatever
    ``cached_text`` shows, repeated. Returns (what was recovered, every raw response body)."""
    known, bodies = "", []
    for _ in range(requests):
        body = complete(server, headers, known + "\x01" * 40)
        bodies.append(json.dumps(body))
        d = body["prefixcache"].get("divergence")
        if not d or not d.get("cached_text"):
            continue
        known += d["cached_text"]
    return known, bodies


def _fragments(text: str, n: int = 8) -> set[str]:
    return {text[i : i + n] for i in range(len(text) - n + 1)}


def test_a_second_key_of_the_tenant_recovers_nothing(serve, make_engine):
    server = serve(make_engine(), api_keys=KEYS, model_name=MODEL)
    complete(server, A, SECRET)
    known, bodies = recover(server, B)
    assert known == ""
    leaked = [f for f in _fragments(SECRET) if any(f in b for b in bodies)]
    assert leaked == []
    # The structure remains: where the guess left the cached prompt, and that text was withheld.
    d = json.loads(bodies[0])["prefixcache"]["divergence"]
    assert d == {
        "token_index": 0,
        "text_before": "",
        "prompt_text": "\x01" * 8,
        "cached_text": None,
        "cached_text_hidden": True,
    }


def test_the_writer_sees_its_own_cached_text_the_other_key_only_what_it_wrote(serve, make_engine):
    server = serve(make_engine(), api_keys=KEYS, model_name=MODEL)
    complete(server, A, SECRET)
    d = complete(server, A, SECRET[:40] + "X" + SECRET[41:])["prefixcache"]["divergence"]
    assert d["token_index"] == 40 and d["cached_text"] == SECRET[40:48]
    assert "cached_text_hidden" not in d
    d = complete(server, B, SECRET[:20] + "Y" + SECRET[21:])["prefixcache"]["divergence"]
    assert d["token_index"] == 20 and d["cached_text"] is None and d["cached_text_hidden"] is True
    # Once B has itself sent the cached block, its text is B's own: shown.
    complete(server, B, SECRET)
    d = complete(server, B, SECRET[:20] + "Z" + SECRET[21:])["prefixcache"]["divergence"]
    assert d["token_index"] == 20 and d["cached_text"] in (SECRET[20:28], "Y" + SECRET[21:28])


def _streamed(server, headers, path: str, body: dict) -> str:
    with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return r.read().decode()


def test_streamed_answers_withhold_the_other_keys_text_too(serve, make_engine):
    """Anthropic's ``message_start`` carries the miss reason from the prefill, before the
    request finishes: it was sent unscreened (8 tokens of the other key's prompt)."""
    server = serve(make_engine(), api_keys=KEYS, model_name=MODEL)
    complete(server, A, SECRET)
    guess = "\x01" * 40
    streams = {
        "/v1/messages": {"messages": [{"role": "user", "content": guess}], "max_tokens": 1},
        "/v1/completions": {"prompt": guess, "max_tokens": 1, "stream_options": {"include_usage": True}},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": guess}],
            "max_tokens": 1,
            "stream_options": {"include_usage": True},
        },
        "/v1/responses": {"input": guess, "max_output_tokens": 1},
    }
    texts = {
        path: _streamed(server, B, path, {"model": MODEL, "stream": True, **body})
        for path, body in streams.items()
    }
    assert {path: [f for f in _fragments(SECRET) if f in text] for path, text in texts.items()} == {
        path: [] for path in streams
    }
    start = texts["/v1/messages"]
    message = json.loads(next(line for line in start.splitlines() if '"message_start"' in line)[6:])
    d = message["message"]["prefixcache"]["divergence"]
    assert d["token_index"] == 0 and d["cached_text"] is None and d["cached_text_hidden"] is True
    # The writer's own text is still shown there.
    said = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 1}
    assert httpx.post(server.url + "/v1/messages", json=said, headers=A, timeout=60).status_code == 200
    edited = [{"role": "user", "content": SECRET[:40] + "X" + SECRET[41:]}]
    start = _streamed(server, A, "/v1/messages", {**said, "messages": edited, "stream": True})
    message = json.loads(next(line for line in start.splitlines() if '"message_start"' in line)[6:])
    assert message["message"]["prefixcache"]["divergence"]["cached_text"] == SECRET[40:48]


def test_without_keys_on_loopback_the_single_user_sees_everything(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    complete(server, {}, SECRET)
    known, _ = recover(server, {})
    assert SECRET[:60] in known  # as before: one user, its own prompts


def test_without_keys_on_an_exposed_address_no_cached_text(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL, caller_text=TextPolicy.NONE)
    complete(server, {}, SECRET)
    known, bodies = recover(server, {})
    assert known == "" and not [f for f in _fragments(SECRET) if any(f in b for b in bodies)]


def test_dashboard_previews_and_busting_examples_of_another_key_are_withheld(serve, make_engine):
    server = serve(
        make_engine(), api_keys=KEYS, model_name=MODEL, admin_tenants=["ops"], dashboard_interval_s=3600
    )
    for _ in range(2):
        complete(server, A, SECRET)  # the second one hits: a top prefix of tenant acme
    mine = httpx.get(server.url + "/v1/dashboard", headers=A, timeout=30).json()["top_prefixes"]
    theirs = httpx.get(server.url + "/v1/dashboard", headers=B, timeout=30).json()["top_prefixes"]
    admin = httpx.get(server.url + "/v1/dashboard", headers=ADMIN, timeout=30).json()["top_prefixes"]
    assert len(mine) == len(theirs) == len(admin) == 1
    assert mine[0]["preview"].startswith("The launch code")
    assert theirs[0]["preview"] is None and theirs[0]["preview_hidden"] is True
    assert theirs[0]["prefix_tokens"] == mine[0]["prefix_tokens"]  # the structure remains
    assert admin[0]["preview"] == mine[0]["preview"]
    assert not [f for f in _fragments(SECRET) if f in json.dumps(theirs)]


@pytest.mark.parametrize(
    ("policy", "tenant", "admin", "shown"),
    [
        (TextPolicy.OWN, "acme", False, False),  # a tenant of two keys: the examples may be the other's
        (TextPolicy.OWN, "acme", True, True),  # an admin tenant sees everything
        (TextPolicy.OWN, "solo", False, True),  # the only key of its tenant: its own prompts
        (TextPolicy.ALL, "default", False, True),
        (TextPolicy.NONE, "default", False, False),
    ],
)
def test_busting_report_examples_only_for_a_caller_who_may_see_them(policy, tenant, admin, shown):
    from prefixcache.server.auth import Tenant
    from prefixcache.server.caller_text import CallerText

    text = CallerText(policy, lambda t, ids: [], 16, shared=frozenset({"acme"}))
    report = {"endpoints": [{"endpoint": "/v1/chat", "busting": [{"kind": "uuid", "examples": ["a-b-c"]}]}]}
    out = text.busting_report(Tenant(tenant, b"s", admin=admin, credential="c"), report)
    row = out["endpoints"][0]["busting"][0]
    assert row["examples"] == (["a-b-c"] if shown else [])
    assert row.get("examples_hidden", False) is not shown
