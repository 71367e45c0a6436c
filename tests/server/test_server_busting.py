"""``GET /v1/cache/report`` through the real server: a timestamp planted at the top of a tenant's
system prompt is reported at its token, with a warning in the log and the metrics; another
tenant's report never shows it."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

MODEL = "m"
KEYS = {"key-a": "alpha", "key-b": "beta"}
BODY = (
    "You are the support assistant of a small bicycle shop. Answer in one short sentence. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; closed on Sundays. "
    "We repair brakes, gears, wheels and e-bike motors, and we sell city, road and cargo bikes. "
) * 3
LABEL = "Current time:\n"
STAMPS = [f"2026-12-01T07:{m:02d}:{s:02d}Z" for m, s in ((12, 5), (13, 41), (15, 2), (18, 30))]
QUESTIONS = ["Open on Sunday?", "Do you fix brakes?", "Cargo bikes?", "Weekday hours?"]


def _messages(stamp: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": LABEL + stamp + "\n" + BODY}, {"role": "user", "content": question}]


def _planted_token(engine) -> int:
    """The stamp's first token: where the prompts with and without the stamp part."""
    with_stamp = engine.render_ids(_messages(STAMPS[0], QUESTIONS[0]))
    without = engine.render_ids(
        [{"role": "system", "content": LABEL}, {"role": "user", "content": QUESTIONS[0]}]
    )
    return next(i for i, (a, b) in enumerate(zip(with_stamp, without, strict=False)) if a != b)


def _run(server, engine, caplog) -> None:
    a = openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
    for stamp, question in zip(STAMPS, QUESTIONS, strict=True):
        a.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0, messages=_messages(stamp, question)
        )
    # Tenant beta: the same body without a stamp (clean: shares its whole system prompt).
    for question in QUESTIONS[:3]:
        b.chat.completions.create(
            model=MODEL,
            max_tokens=1,
            temperature=0,
            messages=[{"role": "system", "content": BODY}, {"role": "user", "content": question}],
        )
    server.state.busting.wait_idle()
    report = httpx.get(server.url + "/v1/cache/report", headers={"authorization": "Bearer key-a"}).json()
    assert report["tenant"] == "alpha"
    [row] = report["endpoints"]
    assert (row["endpoint"], row["requests"], row["window_pairs"]) == ("/v1/chat/completions", 4, 3)
    [finding] = row["busting"]
    assert finding["kind"] == "timestamp"
    assert finding["start_token"] == _planted_token(engine)
    assert finding["share_of_requests"] == 1.0
    assert set(finding["examples"]) <= set(STAMPS) and len(finding["examples"]) == 3
    other = httpx.get(server.url + "/v1/cache/report", headers={"authorization": "Bearer key-b"}).json()
    assert other["tenant"] == "beta"
    assert [(r["endpoint"], r["requests"], r["busting"]) for r in other["endpoints"]] == [
        ("/v1/chat/completions", 3, [])
    ]
    warnings = [r.getMessage() for r in caplog.records if r.name == "prefixcache.server.ops.busting"]
    assert len(warnings) == 1 and "'alpha'" in warnings[0] and "timestamp" in warnings[0]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'prefixcache_cache_busting_findings_total{kind="timestamp"} 1.0' in metrics
    assert "prefixcache_cache_busting_active_findings 1.0" in metrics


def test_busting_report_on_the_tiny_model(serve, make_engine, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.server.ops.busting")
    engine = make_engine()
    server = serve(engine, model_name=MODEL, api_keys=KEYS, salt_secret="s")
    _run(server, engine, caplog)
    # Off: a 400 that names the flag.
    off = serve(make_engine(), model_name=MODEL, busting_window=0)
    r = httpx.get(off.url + "/v1/cache/report")
    assert r.status_code == 400 and "--busting-window" in r.text


def test_unauthenticated_report_is_refused(serve, make_engine) -> None:
    server = serve(make_engine(), model_name=MODEL, api_keys=KEYS, salt_secret="s")
    assert httpx.get(server.url + "/v1/cache/report").status_code == 401


@pytest.mark.model
def test_busting_report_on_smollm2(serve, real_engine, one_torch_thread, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="prefixcache.server.ops.busting")
    server = serve(real_engine, model_name=MODEL, api_keys=KEYS, salt_secret="s")
    _run(server, real_engine, caplog)
