"""The audit on synthetic traces whose answers are known (planted spans, fixed gaps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from analysis_traces import fixed_gap_trace, make_trace

from prefixcache.analysis.audit import AuditConfig, audit
from prefixcache.analysis.trace import load_trace


def _row(res, name: str) -> dict:
    return next(e for e in res.endpoints if e["endpoint"] == name)


@pytest.mark.parametrize(
    ("kind", "at", "expected_kind"),
    [
        ("timestamp", "top", "timestamp"),
        ("uuid", "middle", "uuid"),
        ("counter", "top", "counter"),
        ("hex_id", "middle", "hex_id"),
        ("epoch", "top", "timestamp"),
    ],
)
def test_planted_busting_span_is_found_at_its_position(
    tmp_path: Path, kind: str, at: str, expected_kind: str
) -> None:
    p = make_trace(tmp_path / "t.jsonl", [f"ep:rate=2,system=600,bust={kind},bust_at={at}"], 300)
    trace = load_trace(p)
    planted = trace.header["planted"][0]
    res = audit(trace, AuditConfig(replay=False))
    busting = _row(res, "ep")["busting"]
    assert len(busting) == 1, busting
    b = busting[0]
    assert b["kind"] == expected_kind
    assert b["start_token"] == planted["start_token"]  # the byte tokenizer makes positions exact
    assert b["length_tokens"] == max(len(x) for x in b["examples"])  # one byte, one token
    # What sits below the value is the rest of the system prompt (and a little of its own line).
    below = 600 if at == "top" else 300
    assert below <= b["tokens_lost_per_request"] <= below + 40
    assert len(b["examples"]) == 3 and len(set(b["examples"])) == 3


def test_clean_trace_has_no_busting_finding(tmp_path: Path) -> None:
    p = make_trace(
        tmp_path / "t.jsonl",
        ["a:rate=2,system=800", "b:rate=1,system=500,turns=3", "c:rate=1,system=300,deploys=100"],
        600,
    )
    res = audit(load_trace(p), AuditConfig(replay=False))
    assert all(e["busting"] == [] for e in res.endpoints)
    assert _row(res, "c")["prefix_versions"] == 2  # one deploy: two versions
    assert _row(res, "a")["prefix_versions"] == 1 and _row(res, "a")["dominant_prefix_share"] == 1.0


@pytest.mark.parametrize("always_replay", [False, True], ids=["scan", "replay"])
def test_ttl_shorter_than_gaps_quiet_endpoint_near_zero_busy_near_full(
    tmp_path: Path, always_replay: bool
) -> None:
    trace = load_trace(fixed_gap_trace(tmp_path / "g.jsonl"))
    res = audit(
        trace, AuditConfig(ttl_s=300, always_replay=always_replay)
    )  # the scan's hits, or a PrefixCache replay's
    assert res.achieved_source.startswith("replay" if always_replay else "PrefixCache, TTL 300 s")
    busy, quiet = _row(res, "busy"), _row(res, "quiet")
    # quiet: every gap (900 s) exceeds the TTL, so nothing is ever served from the cache.
    assert quiet["hit_rate"] == 0.0
    assert quiet["achievable_hit_rate"] == pytest.approx(7 * 1024 / (8 * 1056))
    assert quiet["ttl_expired_requests"] == 7
    assert quiet["keep_warm"] is True and quiet["keep_warm_prefix_tokens"] == 1024
    hist = quiet["reuse_gap_s"]["histogram"]
    assert hist["counts"][hist["edges_s"].index(600.0)] == 7  # every 900 s gap in [2 x TTL, 1 h)
    # busy: 1 s gaps; all but the first request read the 1,024-token system prompt (64 blocks).
    assert busy["hit_rate"] == pytest.approx(199 * 1024 / (200 * 1056))
    assert busy["ttl_expired_requests"] == 0 and busy["keep_warm"] is False
    assert busy["divergence"]["p50"] == 1024


def test_achieved_comes_from_trace_when_measured(tmp_path: Path) -> None:
    from prefixcache.analysis.trace import TraceWriter

    p = tmp_path / "m.jsonl"
    with TraceWriter(p) as w:
        for i in range(4):
            w.request(float(i), tokens=list(range(100)) + [i], cached_tokens=48 if i else 0)
    res = audit(load_trace(p), AuditConfig())
    assert res.achieved_source == "trace cached_tokens"
    assert res.hit_rate == pytest.approx(3 * 48 / (4 * 101))
    assert res.achievable_hit_rate == pytest.approx(3 * 96 / (4 * 101))


def test_audit_json_shape(scenario_trace: Path) -> None:
    res = audit(load_trace(scenario_trace), AuditConfig())
    d = res.as_dict()
    for e in d["endpoints"]:
        assert isinstance(e["endpoint"], str) and isinstance(e["requests"], int)
        assert 0.0 <= e["hit_rate"] <= e["achievable_hit_rate"] + 1e-9 <= 1.0 + 1e-9
        assert isinstance(e["prefix_versions"], int) and isinstance(e["ttl_expired_requests"], int)
        assert isinstance(e["keep_warm"], bool)
        for b in e["busting"]:
            assert set(b) >= {"start_token", "length_tokens", "kind", "examples", "tokens_lost_per_request"}
    kinds = {e["endpoint"]: [b["kind"] for b in e["busting"]] for e in d["endpoints"]}
    kinds.pop("nightly", None)  # rate 0.002/s: may have no request in 350 s
    assert kinds == {"chat": [], "support": ["timestamp"], "search": ["uuid"], "agent": []}


def _same(a, b) -> None:
    import numpy as np

    assert a.as_dict() == b.as_dict()
    for f in ("achieved", "achievable", "diverge", "gap_s"):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


def test_replay_in_a_forked_child_matches_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import multiprocessing as mp

    audit_mod = importlib.import_module("prefixcache.analysis.audit")  # the package exports the function

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    trace = load_trace(fixed_gap_trace(tmp_path / "g.jsonl"))
    seen: list[tuple[str, int]] = []
    cfg = AuditConfig(ttl_s=300, always_replay=True)
    inproc = audit(trace, cfg)
    monkeypatch.setattr(audit_mod, "_FORK_MIN_REQUESTS", 0)
    forked = audit(trace, cfg, progress=lambda stage, k: seen.append((stage, k)))
    _same(inproc, forked)
    assert forked.achieved.sum() > 0 and ("scan", 0) in seen and ("replay", len(trace)) in seen

    def broken(*_a: object) -> None:
        raise SystemExit(3)

    monkeypatch.setattr(audit_mod, "_replay_child_main", broken)  # the child dies: replay in-process
    _same(inproc, audit(trace, cfg))


@pytest.mark.parametrize(
    ("ttl", "align", "block"),
    [(300, None, 16), (30, None, 16), (5, None, 16), (60, 64, 16), (45, 512, 16), (20, None, 4), (45, 32, 4)],
)
def test_the_scans_hits_are_the_prefixcache_replays(
    tmp_path: Path, ttl: float, align: int | None, block: int
) -> None:
    """The audit's achieved hits without a replay (the scan's within-TTL depths) equal, request
    for request, a replay through the real PrefixCache: busy and quiet endpoints, tenants,
    multi-turn chats, deploys, busting, bursts."""
    trace = load_trace(
        make_trace(
            tmp_path / "mix.jsonl",
            [
                "a:rate=0.3,system=300,turns=4,tenant=x",
                "b:rate=0.1,system=64,user=8,tenant=y,arrival=bursty",
                "c:rate=0.05,system=2000,bust=hex_id,bust_at=bottom",
                "d:rate=0.02,system=500,deploys=3000;9000,turns=2,tenant=x",
                "e:rate=0.004,system=900,arrival=diurnal",
            ],
            3000,
            seed=9,
        )
    )
    cfg = AuditConfig(ttl_s=ttl, align_tokens=align, block_size=block)
    scan = audit(trace, cfg)
    replay = audit(trace, AuditConfig(ttl_s=ttl, align_tokens=align, block_size=block, always_replay=True))
    assert scan.achieved_source.startswith("PrefixCache") and replay.achieved_source.startswith("replay")
    assert np.array_equal(scan.achieved, replay.achieved)
    assert 0 < scan.achieved.sum() < scan.achievable.sum()  # the TTL costs something here


def test_a_trace_with_its_own_ttls_is_replayed(tmp_path: Path) -> None:
    from prefixcache.analysis.trace import TraceWriter

    p = tmp_path / "t.jsonl"
    with TraceWriter(p) as w:
        for i in range(30):
            w.request(400.0 * i, tokens=list(range(64)) + [i], ttl=3600 if i % 2 else None)
    res = audit(load_trace(p), AuditConfig(ttl_s=300))
    assert res.achieved_source.startswith("replay")
    # Requests 400 s apart, 65 tokens (4 blocks of 16 may hit): only the 1 h class keeps the prefix,
    # written by request 1 (its blocks from request 0 had expired) and refreshed from then on; a
    # scan of 300 s reuse gaps alone would say 0 throughout.
    assert res.achieved.tolist() == [0, 0] + [64] * 28


def test_scan_matches_across_block_sizes_and_alignment(scenario_trace: Path) -> None:
    """Smaller blocks and a prefill alignment exercise more runs, partial blocks and the TTL walk."""
    trace = load_trace(scenario_trace)
    for cfg in (
        AuditConfig(replay=False, block_size=4, ttl_s=30),
        AuditConfig(replay=False, align_tokens=64, ttl_s=5),
    ):
        res = audit(trace, cfg)
        assert (res.achievable <= res.prompt_tokens).all() and (res.diverge <= res.prompt_tokens).all()
        assert (res.achievable % (cfg.align_tokens or cfg.block_size) == 0).all()
