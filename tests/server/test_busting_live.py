"""The live cache-busting watch (``server/ops/busting.py``) on traffic replayed from synthetic traces
with planted busting: every planted span is found at its planted token, and the clean endpoints
(multi-turn chats, long random tails, prompt deploys, plain traffic, and all of them interleaved
on one endpoint: distinct system prompts side by side) raise nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prefixcache.analysis.trace import ByteTokenizer, load_trace
from prefixcache.analysis.trace.spans import BustingDetector, Pair, find_busting
from prefixcache.analysis.trace.synth import parse_endpoint, synthesize
from prefixcache.server.ops.busting import LiveBusting

BUSTING = (
    "stamp:rate=2,system=600,bust=timestamp,tenant=acme",
    "ids:rate=2,system=600,bust=uuid,bust_at=middle,tenant=acme",
    "count:rate=2,system=600,bust=counter,bust_at=middle,tenant=globex",
    "epoch:rate=2,system=600,bust=epoch,tenant=globex",
    "hexy:rate=2,system=600,bust=hex_id,bust_at=middle,tenant=acme",
)
CLEAN = (
    "chat:rate=2,system=600,turns=4,tenant=acme",
    "rag:rate=2,system=600,user=400,tenant=acme",
    "deploy:rate=2,system=600,deploys=40;80,tenant=globex",
    "plain:rate=2,system=600,tenant=globex",
)
#: The audit's kind for each planted value (an epoch is a timestamp).
KIND = {
    "timestamp": "timestamp",
    "epoch": "timestamp",
    "uuid": "uuid",
    "counter": "counter",
    "hex_id": "hex_id",
}


@pytest.fixture(scope="module")
def replayed(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[LiveBusting, list[tuple[str, str, int]], dict]:
    path = Path(tmp_path_factory.mktemp("busting")) / "t.jsonl"
    specs = [parse_endpoint(s) for s in (*BUSTING, *CLEAN)]
    synthesize(path, specs, duration_s=120.0, seed=3)
    trace = load_trace(path)
    raised: list[tuple[str, str, int]] = []
    live = LiveBusting(
        ByteTokenizer, window=32, on_finding=lambda t, e, f: raised.append((e, f.kind, f.start_token))
    )
    clean = {spec.split(":")[0] for spec in CLEAN}
    for i in range(len(trace)):
        name, tokens, ts = trace.endpoint_name(i), trace.tokens(i), float(trace.ts[i])
        live.observe(trace.tenant_name(i), name, tokens, ts)
        if name in clean:  # every clean endpoint again, interleaved on one endpoint of another tenant
            live.observe("initech", "mixed", tokens, ts)
    return live, raised, trace.header


def test_every_planted_span_is_found_live_at_its_token(replayed) -> None:
    live, raised, header = replayed
    planted = {(p["endpoint"], KIND[p["kind"]], p["start_token"]) for p in header["planted"]}
    assert len(planted) == len(BUSTING)
    # Raised once each (the log warning and the counter), and nothing else anywhere.
    assert sorted(raised) == sorted(planted)
    assert live.raised == {"timestamp": 2, "uuid": 1, "counter": 1, "hex_id": 1}
    for tenant in ("acme", "globex"):
        for row in live.report(tenant)["endpoints"]:
            found = {(row["endpoint"], b["kind"], b["start_token"]) for b in row["busting"]}
            expected = {p for p in planted if p[0] == row["endpoint"]}
            assert found == expected, row["endpoint"]


def test_clean_endpoints_raise_nothing_and_reports_stay_per_tenant(replayed) -> None:
    live, _, _ = replayed
    acme = {r["endpoint"]: r for r in live.report("acme")["endpoints"]}
    globex = {r["endpoint"]: r for r in live.report("globex")["endpoints"]}
    assert set(acme) == {"stamp", "ids", "hexy", "chat", "rag"}
    assert set(globex) == {"count", "epoch", "deploy", "plain"}
    for rows in (acme, globex):
        for name in ("chat", "rag", "deploy", "plain"):
            if name in rows:
                assert rows[name]["busting"] == []
                assert rows[name]["window_pairs"] == 32
    # Distinct system prompts, chats, RAG tails and deploys interleaved on one endpoint: nothing.
    [mixed] = live.report("initech")["endpoints"]
    assert (mixed["endpoint"], mixed["busting"], mixed["window_pairs"]) == ("mixed", [], 32)
    assert live.report("nobody")["endpoints"] == []
    stamp = acme["stamp"]["busting"][0]
    # The audit's busting row schema, in its order.
    assert list(stamp) == [
        "start_token",
        "length_tokens",
        "kind",
        "examples",
        "tokens_lost_per_request",
        "share_of_requests",
        "saving_tokens_if_moved_below",
        "saving_tokens_if_all_moved_below",
        "stacked_with",
        "saving_usd_if_moved_below",
        "saving_usd_if_all_moved_below",
    ]
    assert stamp["stacked_with"] == []  # alone: moving it saves what moving all saves
    assert stamp["saving_tokens_if_moved_below"] == stamp["saving_tokens_if_all_moved_below"]
    assert stamp["share_of_requests"] == 1.0  # every pair in the window diverges at the stamp


def test_memory_is_bounded_by_tenants_endpoints_window_and_prompt_cap() -> None:
    live = LiveBusting(ByteTokenizer, window=4, max_endpoints=2, max_tenants=2, max_prompt_tokens=100)
    rng = np.random.default_rng(0)
    for tenant in ("t0", "t1", "t2"):
        for endpoint in ("e0", "e1", "e2"):
            for _ in range(6):
                live.observe(tenant, endpoint, rng.integers(97, 123, 500), 0.0)
    # Full: 2 tenants x 2 endpoints x 4 prompts x 100 tokens x 4 bytes, and not one more.
    assert live.memory_bytes() == 2 * 2 * 4 * 100 * 4
    reports = [[r["endpoint"] for r in live.report(t)["endpoints"]] for t in ("t0", "t1", "t2")]
    assert reports == [[], ["e1", "e2"], ["e1", "e2"]]  # the least recently seen went first


def test_the_detector_windowed_and_whole_agree_with_find_busting() -> None:
    """The audit's ``find_busting`` is the detector fed every pair; a window keeps the last pairs."""
    tok = ByteTokenizer()
    body = np.frombuffer(b"x" * 0 + bytes(range(97, 123)) * 8, dtype=np.uint8).astype(np.uint32)

    def prompt(stamp: str) -> np.ndarray:
        return np.concatenate([np.array(tok.encode(f"Now: {stamp}\n"), dtype=np.uint32), body])

    stamps = [f"2026-12-01T07:{m:02d}:00Z" for m in range(10)]
    pairs = [Pair(i, float(i), prompt(stamps[i]), prompt(stamps[i - 1]), 15) for i in range(1, 10)]
    whole = find_busting(pairs, ByteTokenizer)
    assert [(f.kind, f.start_token, len(f.shared_after)) for f in whole] == [("timestamp", 5, 9)]
    windowed = BustingDetector(ByteTokenizer, window=3)
    for p in pairs:
        windowed.add(p)
    assert len(windowed) == 3
    [f] = windowed.findings()
    assert [v for _, v in f.examples] == stamps[7:10]
