"""The live dashboard: ``GET /v1/dashboard``'s numbers, its tenant scoping, and the page itself in
headless Chromium (DOM assertions before and after more traffic)."""

from __future__ import annotations

import httpx
import pytest

from prefixcache.server.auth import Authenticator
from prefixcache.server.ops.dashboard import DashboardRecorder, DashboardSources

MODEL = "test-model"
SYSTEM_A = "Alpha's handbook for support agents: be brief and kind. " * 4
SYSTEM_B = "Beta's style sheet for release notes, strictly formal. " * 4
KEYS = {"sk-alpha": "alpha", "sk-beta": "beta", "sk-ops": "ops"}


def chat(url: str, system: str, user: str, key: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return answer(url, messages, key)["usage"]


def answer(url: str, messages: list[dict], key: str | None = None) -> dict:
    """A chat completion's whole body (its ``usage`` and its ``prefixcache`` object)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "max_tokens": 2, "messages": messages}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def missed_by_reason(answers: list[dict]) -> dict[str, int]:
    """The answers' ``cache_missed_tokens`` summed by reason (reasons that cost tokens only)."""
    out: dict[str, int] = {}
    for a in answers:
        pc = a["prefixcache"]
        if pc["cache_missed_tokens"]:
            out[pc["reason"]] = out.get(pc["reason"], 0) + pc["cache_missed_tokens"]
    return out


def dashboard(url: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/v1/dashboard", headers=headers, timeout=30)


# ---------------------------------------------------------------------------- the recorder alone
class FakeSources:
    def __init__(self) -> None:
        self.prefilled = 0
        self.depth = 0

    def sources(self) -> DashboardSources:
        return DashboardSources(
            keys=lambda tenant, salt, ids: [
                f"{tenant}:{len(ids[: i + 1])}".encode() for i in range(len(ids))
            ],
            decode=lambda ids: "".join(chr(97 + i % 26) for i in ids),
            prefilled=lambda: self.prefilled,
            queue_depth=lambda: self.depth,
        )


def test_recorder_series_totals_and_top_prefixes_are_exact() -> None:
    fake = FakeSources()
    now = [1000.0]
    rec = DashboardRecorder(fake.sources(), interval_s=2.0, points=3, top=2, clock=lambda: now[0])
    prefix = list(range(32))
    rec.note("a", b"s", prefix + [1, 2], 34, 0, 32, 0.5, "miss")
    fake.prefilled = 34
    rec.note("a", b"s", prefix + [3, 4], 34, 32, 0, 0.1, "partial")
    rec.note("a", b"s", prefix + [5, 6], 34, 32, 0, 0.3, "partial")
    rec.note("b", b"t", prefix[:16] + [9], 17, 16, 0, None, "partial")
    fake.depth = 3
    now[0] = 1002.0
    point = rec.sample()
    assert point == {
        "t": 1002.0,
        "requests": 4,
        "prompt_tokens": 119,
        "cached_tokens": 80,
        "written_tokens": 32,
        "prefilled_tokens": 34,
        "hit_rate": round(80 / 119, 4),
        "ttft_hit_s": None,
        "ttft_partial_s": 0.2,
        "ttft_miss_s": 0.5,
        "ttft_hit_per_1k_s": None,
        "ttft_partial_per_1k_s": round(0.2 * 1000 / 34, 6),
        "ttft_miss_per_1k_s": round(0.5 * 1000 / 34, 6),
        "queue_depth": 3,
    }
    # A quiet interval: zeros, no hit rate, and the prefilled counter's delta only.
    fake.prefilled = 40
    assert rec.sample()["prefilled_tokens"] == 6 and rec.sample()["hit_rate"] is None
    rec.sample()
    assert len(rec.view(None)["series"]) == 3  # the ring buffer keeps the last 3 points

    # Tenant a's prefix is named by the key of its last cached block; b sees only its own.
    a_top = rec.top_prefixes("a")
    assert a_top == [
        {
            "key": b"a:32".hex(),
            "tenant": "a",
            "prefix_tokens": 32,
            "tokens_saved": 64,
            "hits": 2,
            "last_hit": 1000.0,
            "preview": "".join(chr(97 + i % 26) for i in range(32)),
        }
    ]
    assert [p["key"] for p in rec.top_prefixes("b")] == [b"b:16".hex()]
    assert [p["tenant"] for p in rec.top_prefixes(None)] == ["a", "b"]
    view = rec.view("b")
    assert view["totals"]["requests"] == 4 and view["totals"]["cached_tokens"] == 80
    assert view["ttft"]["partial"] == {"count": 2, "p50_s": 0.3, "p90_s": 0.3}
    # Hits against misses of prompts of one length: every prompt here is under 512 tokens.
    [short] = view["ttft_by_length"]
    assert (short["min_tokens"], short["max_tokens"]) == (1, 512)
    assert short["miss"] == {"count": 1, "p50_s": 0.5, "p90_s": 0.5} and short["hit"]["count"] == 0
    assert [p["tenant"] for p in view["top_prefixes"]] == ["b"]


def test_recorder_keeps_the_top_prefixes_of_each_tenant_bounded() -> None:
    fake = FakeSources()
    rec = DashboardRecorder(fake.sources(), top=2)
    for n in (16, 32, 48, 64, 80):  # five distinct prefixes; 80 saves most, 16 least
        for _ in range(n // 16):
            rec.note("a", b"s", list(range(n)) + [0], n + 1, n, 0, 0.1, "partial")
        rec.digest()
    # Past 2 * top entries the 2 best stay, then new ones join until the next trim.
    assert [p["prefix_tokens"] for p in rec.top_prefixes("a")] == [80, 64]
    assert rec.top_prefixes("a")[0]["tokens_saved"] == 80 * 5


def test_admin_tenant_must_name_a_tenant_of_the_key_file() -> None:
    with pytest.raises(ValueError, match="no key in the key file"):
        Authenticator({"k": "alpha"}, "s", admin_tenants=["ops"])
    with pytest.raises(ValueError, match="needs API keys"):
        Authenticator(None, "s", admin_tenants=["default"])
    auth = Authenticator({"k": "alpha", "o": "ops"}, "s", admin_tenants=["ops"])
    assert auth.authenticate("Bearer o", None).admin and not auth.authenticate("Bearer k", None).admin


# ---------------------------------------------------------------------------- the JSON over HTTP
def test_dashboard_json_counts_the_traffic_and_names_the_prefix(serve, make_engine) -> None:
    server = serve(make_engine(), model_name=MODEL, dashboard_interval_s=0.05)
    usages = [chat(server.url, SYSTEM_A, f"question {i}") for i in range(3)]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] == 0 and cached[1] == cached[2] > 0
    d = dashboard(server.url).json()
    t = d["totals"]
    assert t["requests"] == 3
    assert t["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert t["cached_tokens"] == sum(cached)
    assert t["written_tokens"] == sum(u["prompt_tokens_details"]["cache_write_tokens"] for u in usages)
    assert t["prefilled_tokens"] == server.engine.prefilled_tokens == t["prompt_tokens"] - t["cached_tokens"]
    assert t["hit_rate"] == round(sum(cached) / t["prompt_tokens"], 4)
    assert d["ttft"]["miss"]["count"] == 1 and d["ttft"]["partial"]["count"] == 2
    # The one prefix both hits read: the cache's own key of its last block, the tokens it saved.
    state = server.state
    ids = state.bridge.render_ids(
        [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "question 1"}]
    )
    ns = state.bridge.namespace("default", state.auth.salt_for("default"))
    key = state.bridge.cache.block_keys(ids[: cached[1]], ns)[-1].hex()
    (top,) = d["top_prefixes"]
    assert top["key"] == key and top["tenant"] == "default"
    assert top["tokens_saved"] == 2 * cached[1] and top["hits"] == 2 and top["prefix_tokens"] == cached[1]
    assert "Alpha's handbook" in top["preview"]
    assert d["cache"]["blocks"] == state.bridge.cache.stats().blocks > 0
    assert d["tiers"] == [] and d["busting"] == []
    # Every interval's tokens add up to the totals (the series sampled them all).
    server.state.dashboard.sample()
    series = dashboard(server.url).json()["series"]
    assert sum(p["cached_tokens"] for p in series) == t["cached_tokens"]
    assert sum(p["requests"] for p in series) == 3


def test_dashboard_json_scopes_prefixes_to_the_callers_tenant(serve, make_engine) -> None:
    server = serve(make_engine(), model_name=MODEL, api_keys=KEYS, salt_secret="x", admin_tenants=["ops"])
    for i in range(2):
        chat(server.url, SYSTEM_A, f"a{i}", "sk-alpha")
        chat(server.url, SYSTEM_B, f"b{i}", "sk-beta")
    r = dashboard(server.url)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert dashboard(server.url, "sk-nope").status_code == 401
    alpha, beta, ops = (dashboard(server.url, k).json() for k in ("sk-alpha", "sk-beta", "sk-ops"))
    assert [(p["tenant"], "Alpha's" in p["preview"]) for p in alpha["top_prefixes"]] == [("alpha", True)]
    assert [(p["tenant"], "Beta's" in p["preview"]) for p in beta["top_prefixes"]] == [("beta", True)]
    assert "Beta's" not in str(alpha) and "Alpha's" not in str(beta)
    assert alpha["tenant_cache"]["tenant"] == "alpha" and alpha["tenant_cache"]["requests"] == 2
    assert not alpha["admin"] and ops["admin"]
    assert sorted(p["tenant"] for p in ops["top_prefixes"]) == ["alpha", "beta"]
    assert ops["top_prefixes"] == sorted(
        alpha["top_prefixes"] + beta["top_prefixes"], key=lambda p: (-p["tokens_saved"], p["key"])
    )
    # The page itself loads without a key, under a policy that allows only its own origin.
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for asset in ("dashboard.css", "common.js", "server.js"):
        assert httpx.get(f"{server.url}/dashboard/{asset}").status_code == 200
    assert httpx.get(server.url + "/dashboard/router.py").status_code == 404


STAMPED_BODY = (
    "You are the support assistant of a small bicycle shop. Answer in one short sentence. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; closed on Sundays. "
) * 3
STAMPS = [f"2026-12-01T07:{m:02d}:{s:02d}Z" for m, s in ((12, 5), (13, 41), (15, 2), (18, 30))]


def test_miss_reason_and_busting_panels(serve, make_engine, browse) -> None:
    """A timestamp at the top of alpha's system prompt: alpha's busting panel shows the live
    watch's finding, beta's shows none; a flush of beta's cache shows as ``flushed`` tokens."""
    server = serve(make_engine(), model_name=MODEL, api_keys=KEYS, salt_secret="x", admin_tenants=["ops"])
    answers = []
    for i, stamp in enumerate(STAMPS):
        system = "Current time:\n" + stamp + "\n" + STAMPED_BODY
        answers.append(
            answer(
                server.url,
                [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                "sk-alpha",
            )
        )
    clean = [{"role": "system", "content": STAMPED_BODY}, {"role": "user", "content": "Open on Sunday?"}]
    answers.append(answer(server.url, clean, "sk-beta"))
    assert (
        httpx.delete(server.url + "/v1/cache", headers={"authorization": "Bearer sk-beta"}).status_code == 200
    )
    answers.append(answer(server.url, clean, "sk-beta"))
    assert answers[-1]["prefixcache"]["reason"] == "flushed"
    server.state.busting.wait_idle()

    alpha = dashboard(server.url, "sk-alpha").json()
    beta = dashboard(server.url, "sk-beta").json()
    expected = missed_by_reason(answers)
    assert expected["flushed"] == answers[-1]["prefixcache"]["cache_missed_tokens"] > 0
    assert alpha["miss_reasons"] == beta["miss_reasons"] == expected  # server-wide, as /metrics
    report = httpx.get(server.url + "/v1/cache/report", headers={"authorization": "Bearer sk-alpha"}).json()
    [row] = report["endpoints"]
    assert alpha["busting"] == [
        {"tenant": "alpha", "endpoint": "/v1/chat/completions", **f} for f in row["busting"]
    ]
    assert [f["kind"] for f in alpha["busting"]] == ["timestamp"] and beta["busting"] == []
    ops = dashboard(server.url, "sk-ops")
    assert ops.status_code == 200 and "busting" in ops.json(), (ops.status_code, ops.text[:500])
    assert ops.json()["busting"] == alpha["busting"]  # admin: every tenant's

    dom = browse(server.url + "/dashboard#key=sk-alpha")
    [finding] = dom.rows("busting")
    assert finding[:3] == ["alpha", "/v1/chat/completions", "timestamp"]
    assert finding[3] == str(alpha["busting"][0]["start_token"]) and finding[5] == "100.0%"
    assert set(finding[6].split(" · ")) <= set(STAMPS)
    bars = dom.by_id("miss-reasons")[0]
    assert "flushed" in bars and str(expected["flushed"]) in bars and "no data yet" not in bars
    assert browse(server.url + "/dashboard#key=sk-beta").rows("busting") == [["no data yet"]]


def test_dashboard_without_a_cache(serve, make_engine) -> None:
    server = serve(make_engine(enable_cache=False), model_name=MODEL)
    chat(server.url, SYSTEM_A, "q")
    d = dashboard(server.url).json()
    assert d["cache"] == {"enabled": False} and d["tenant_cache"] is None and d["tiers"] == []
    assert d["totals"]["requests"] == 1 and d["totals"]["cached_tokens"] == 0 and d["top_prefixes"] == []


# ---------------------------------------------------------------------------- the page, in Chromium
def axis_labels(html: str, chart: str) -> list[str]:
    import re

    svg = re.search(rf'<svg[^>]*id="{chart}".*?</svg>', html, re.S)
    assert svg is not None, chart
    return re.findall(r'<text[^>]*class="axis"[^>]*>([^<]*)</text>', svg.group(0))


def tick_value(text: str) -> float:
    """A tick label's number ('2.5k' -> 2500, '40%' -> 40)."""
    import re

    scale = 1000.0 if text.rstrip().endswith("k") else 1e6 if text.rstrip().endswith("M") else 1.0
    return float(re.sub(r"[^0-9.]", "", text) or 0) * scale


def nice_step(step: float) -> bool:
    """1, 2, 2.5 or 5 times a power of ten."""
    import math

    if step <= 0:
        return False
    scaled = step / 10 ** math.floor(math.log10(step))
    return any(abs(scaled - m) < 1e-6 for m in (1, 2, 2.5, 5, 10))


def round_ticks(labels: list[str]) -> bool:
    """Ticks evenly spaced by a nice step, each a multiple of it (0, 500, 1000, ... or 0, 2.5, 5)."""
    values = sorted(tick_value(t) for t in labels)
    steps = {round(b - a, 9) for a, b in zip(values, values[1:], strict=False)}
    if len(steps) != 1:
        return False
    (step,) = steps
    return nice_step(step) and all(abs(v / step - round(v / step)) < 1e-6 for v in values)


def test_dashboard_page_shows_live_numbers_in_chromium(serve, make_engine, browse) -> None:
    server = serve(make_engine(), model_name=MODEL, api_keys=KEYS, salt_secret="x", dashboard_interval_s=0.05)
    for i in range(2):
        chat(server.url, SYSTEM_A, f"q{i}", "sk-alpha")
    page_url = server.url + "/dashboard#key=sk-alpha"

    dom = browse(page_url)
    first = dashboard(server.url, "sk-alpha").json()["totals"]
    assert dom.by_id("status")[1]["class"] == "ok"
    assert dom.value("requests") == 2 and dom.value("cached-tokens") == first["cached_tokens"] > 0
    assert dom.value("hit-rate") == first["hit_rate"] > 0
    assert dom.value("prefilled-tokens") == first["prefilled_tokens"] > 0
    assert dom.by_id("tenant")[0] == "tenant alpha"
    (row,) = dom.rows("top-prefixes")
    assert row[1] == "alpha" and row[2] == str(first["cached_tokens"]) and "Alpha's handbook" in row[5]
    assert dom.rows("busting") == [["no data yet"]]  # nothing busts the cache here
    # The charts: a time axis back from "now", and round tick labels.
    for chart in ("chart-hit-rate", "chart-tokens", "chart-queue"):
        labels = axis_labels(dom.html, chart)
        assert "now" in labels, labels
        ticks = [t for t in labels if t != "now" and not t.startswith("-")]
        assert len(ticks) == 5 and round_ticks(ticks), ticks

    for i in range(2, 5):
        chat(server.url, SYSTEM_A, f"q{i}", "sk-alpha")
    dom2 = browse(page_url)
    second = dashboard(server.url, "sk-alpha").json()["totals"]
    assert dom2.value("requests") == 5
    assert dom2.value("cached-tokens") == second["cached_tokens"] > first["cached_tokens"]
    assert dom2.value("hit-rate") == second["hit_rate"] > first["hit_rate"]
    assert dom2.rows("top-prefixes")[0][3] == "4"  # hits of the shared prefix

    # Without a key the page asks for one (the form shows) and shows no numbers.
    dom3 = browse(server.url + "/dashboard")
    assert "hidden" not in dom3.by_id("key-form")[1] and dom3.by_id("requests")[0] == "–"
    assert dom3.by_id("status")[0] == "an API key is needed"


@pytest.mark.model
def test_dashboard_page_with_the_real_model(serve, real_engine, browse) -> None:
    """SmolLM2 behind the page: the prefix's preview is its real decoded text, the numbers are
    the server's."""
    server = serve(real_engine, model_name=MODEL, dashboard_interval_s=0.05)
    usages = [chat(server.url, SYSTEM_A, f"Question number {i}?") for i in range(3)]
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0 and cached > 0
    dom = browse(server.url + "/dashboard")
    totals = dashboard(server.url).json()["totals"]
    assert dom.value("requests") == 3 and dom.value("cached-tokens") == totals["cached_tokens"] == 2 * cached
    assert dom.value("prefilled-tokens") == real_engine.prefilled_tokens == totals["prefilled_tokens"]
    (row,) = dom.rows("top-prefixes")
    assert row[2] == str(2 * cached) and row[3] == "2" and row[4] == str(cached)
    assert row[5].startswith("<|im_start|>system Alpha's handbook for support agents")
    # Hits against misses of prompts of one length: all three prompts fall in one bucket.
    (bucket,) = dom.rows("ttft-table")
    counts = [int(c.rsplit("(", 1)[1].rstrip(")")) if "(" in c else 0 for c in bucket[1:]]
    assert counts[2] == 1 and counts[0] + counts[1] == 2, bucket
