"""The simulator: routing, TTL, keep-warm, sweeps and prices, on traces with known answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from analysis_traces import fixed_gap_trace

from prefixcache.analysis.costs import CostModel, TokenTotals, price, pricing_profile
from prefixcache.analysis.feed import TraceFeed
from prefixcache.analysis.replay_loop import replay_requests
from prefixcache.analysis.simulate import SimConfig, simulate, sweep
from prefixcache.analysis.trace import TraceWriter, load_trace

TINY = CostModel(kv_bytes_per_token=1, prefill_tps=1000.0)  # capacity in tokens


def _multi_endpoint_trace(
    path: Path, endpoints: int = 8, requests: int = 1600, sys_tokens: int = 512
) -> Path:
    rng = np.random.default_rng(3)
    with TraceWriter(path) as w:
        for e in range(endpoints):
            w.segment(f"sys{e}", rng.integers(0, 50_000, sys_tokens))
        for i in range(requests):
            e = int(rng.integers(endpoints))
            w.request(i * 0.25, endpoint=f"e{e}", parts=[f"sys{e}", rng.integers(0, 50_000, 20).tolist()])
    return path


def test_prefix_affinity_beats_round_robin_across_replicas(tmp_path: Path) -> None:
    trace = load_trace(_multi_endpoint_trace(tmp_path / "m.jsonl"))
    # Each replica holds ~4 of the 8 system prompts: round-robin makes every replica serve all 8
    # (LRU thrashes), affinity gives each replica its own ~2.
    base = SimConfig(replicas=4, capacity_bytes=4 * 560, cost=TINY, ttl_s=3600)
    rr = simulate(trace, SimConfig(**{**_fields(base), "routing": "round-robin"}))
    pa = simulate(trace, SimConfig(**{**_fields(base), "routing": "prefix-affinity"}))
    ca = simulate(trace, SimConfig(**{**_fields(base), "routing": "cache-aware"}))
    assert pa.hit_rate > rr.hit_rate + 0.2, (pa.hit_rate, rr.hit_rate)
    assert ca.hit_rate > rr.hit_rate + 0.2, (ca.hit_rate, rr.hit_rate)
    # Affinity pins each endpoint to one replica.
    for e in range(8):
        assert len(set(pa.replica[trace.endpoint == trace.endpoints.index(f"e{e}")].tolist())) == 1


def _fields(cfg: SimConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


@pytest.mark.parametrize(
    "routing", ["round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware"]
)
def test_every_routing_runs_and_is_deterministic(tmp_path: Path, routing: str) -> None:
    trace = load_trace(_multi_endpoint_trace(tmp_path / "m.jsonl", requests=300))
    a = simulate(trace, SimConfig(replicas=3, routing=routing, cost=TINY))
    b = simulate(trace, SimConfig(replicas=3, routing=routing, cost=TINY))
    assert np.array_equal(a.replica, b.replica) and np.array_equal(a.cached, b.cached)
    assert sum(r["requests"] for r in a.replicas) == 300
    assert a.totals.cached == int(a.cached.sum()) <= a.totals.prompt


def test_ttl_sweep_quiet_endpoint_and_keep_warm(tmp_path: Path) -> None:
    trace = load_trace(fixed_gap_trace(tmp_path / "g.jsonl"))
    res = sweep(trace, SimConfig(cost=TINY), "ttl_s", [60.0, 300.0, 1000.0])
    quiet = [next(e for e in r.endpoints if e["endpoint"] == "quiet")["hit_rate"] for r in res]
    busy = [next(e for e in r.endpoints if e["endpoint"] == "busy")["hit_rate"] for r in res]
    assert quiet[:2] == [0.0, 0.0]  # 900 s gaps: TTL 60 and 300 lose every reuse
    assert quiet[2] == pytest.approx(7 * 1024 / (8 * 1056))  # TTL 1000 s keeps it
    assert busy == [pytest.approx(199 * 1024 / (200 * 1056))] * 3
    warm = simulate(trace, SimConfig(cost=TINY, ttl_s=300, keep_warm={"quiet": 1024}))
    # Pinned from the router's first round (before quiet's first request), so every request hits.
    warm_quiet = next(e for e in warm.endpoints if e["endpoint"] == "quiet")
    assert warm_quiet["hit_rate"] == pytest.approx(1024 / 1056)
    # A pin request every 60 s (the router's interval) from the trace's start to its last request.
    assert warm.keep_warm_refreshes == 106
    # The first writes the prefix; each later one reads it but the last block (a match leaves one).
    assert warm.totals.keep_warm_reads == 105 * 1008


def test_keep_warm_pins_on_every_replica_as_the_router_does(tmp_path: Path) -> None:
    """The router pins each policy prefix on every healthy replica: pinned blocks neither expire
    nor are evicted, whatever the routing, the TTL or the other endpoints' pressure on the cache.
    (The simulator used to refresh the prefix at 0.95 x TTL, through the evictable budget and only
    on the owning replica under prefix-affinity.)"""
    trace = load_trace(fixed_gap_trace(tmp_path / "g.jsonl"))
    quiet = trace.endpoints.index("quiet")
    cfg = SimConfig(
        cost=TINY,
        ttl_s=300,
        capacity_bytes=1100,  # one system prompt and its tail: busy's traffic evicts anything else
        replicas=2,
        routing="prefix-affinity",
        keep_warm={"quiet": 1024},
    )
    warm = simulate(trace, cfg)
    assert warm.cached[trace.endpoint == quiet].tolist() == [1024] * 8
    assert warm.keep_warm_refreshes == 2 * 106  # every replica, every round
    for cache in replay_requests(TraceFeed.of(trace, cfg.fingerprint, cfg.block_size), cfg).caches:
        assert cache.pinned_prefixes() == 1 and cache.stats().pinned_blocks == 1024 // 16
    cold = simulate(trace, SimConfig(**{**_fields(cfg), "keep_warm": {}}))
    assert cold.cached[trace.endpoint == quiet].sum() == 0  # 900 s gaps against a 300 s TTL


def test_simulator_counts_match_the_cache_stats(tmp_path: Path) -> None:
    trace = load_trace(fixed_gap_trace(tmp_path / "g.jsonl"))
    res = simulate(trace, SimConfig(cost=TINY, ttl_s=300))
    assert res.totals.prompt == int(trace.prompt_tokens.sum())
    assert res.totals.written == int(res.written.sum())
    # Every full block is written once per miss: 2 system prompts x (1 + quiet's 7 expiries) + tails.
    assert res.totals.cached == 199 * 1024
    assert res.ttft_s[0] == pytest.approx(1056 / 1000.0)


def test_pricing_profiles() -> None:
    t = TokenTotals(prompt=1_000_000, cached=600_000, written=300_000, written_long=0, output=0)
    model = CostModel(prefill_tps=1000.0)
    a = price(t, pricing_profile("anthropic"), model)
    assert a.input_usd == pytest.approx(0.1 * 3.0)  # 100k uncached, not written
    assert a.cache_write_usd == pytest.approx(0.3 * 3.0 * 1.25)
    assert a.cache_read_usd == pytest.approx(0.6 * 3.0 * 0.1)
    assert a.no_cache_usd == pytest.approx(3.0)
    long = price(TokenTotals(prompt=100, written_long=100), pricing_profile("anthropic"), model)
    assert long.cache_write_usd == pytest.approx(100 * 3.0 * 2.0 / 1e6)
    o = price(t, pricing_profile("openai"), model)
    assert o.total_usd == pytest.approx(0.4 * 2.5 + 0.6 * 2.5 * 0.5)
    s = price(t, pricing_profile("self-hosted", gpu_hour=3600.0), model)
    assert s.total_usd == pytest.approx(400_000 / 1000.0)  # $1 per prefill second


def test_keep_warm_file_from_audit_json_or_lines(tmp_path: Path) -> None:
    import json

    from prefixcache.analysis.audit import AuditConfig, audit
    from prefixcache.analysis.simulate import load_keep_warm

    trace = load_trace(fixed_gap_trace(tmp_path / "g.jsonl"))
    report = tmp_path / "audit.json"
    report.write_text(json.dumps(audit(trace, AuditConfig(ttl_s=300, replay=False)).as_dict()))
    assert load_keep_warm(report, trace) == {"quiet": 1024}
    lines = tmp_path / "warm.txt"
    lines.write_text("# endpoint=prefix tokens\nquiet=1024\nbusy = 512\n")
    assert load_keep_warm(lines, trace) == {"quiet": 1024, "busy": 512}
    lines.write_text("quiet:1024\n")
    with pytest.raises(ValueError, match="endpoint=prefix_tokens"):
        load_keep_warm(lines, trace)


def test_sizes_durations_and_sweeps_parse() -> None:
    from prefixcache.analysis.costs import parse_duration, parse_size
    from prefixcache.analysis.simulate import parse_sweep

    assert parse_size("2GiB") == 2 << 30 and parse_size("512MB") == 512_000_000 and parse_size("1e6") == 10**6
    assert parse_duration("5m") == 300 and parse_duration("1h") == 3600 and parse_duration("90") == 90
    assert parse_sweep("ttl=60,300") == ("ttl", ["60", "300"])
    assert parse_sweep("capacity=1GiB,4GiB") == ("capacity", ["1GiB", "4GiB"])
    with pytest.raises(ValueError, match="ttl=60"):
        parse_sweep("speed=1,2")


def test_calibration_from_prefixcache_bench(tmp_path: Path) -> None:
    import json

    from prefixcache.analysis.costs import DEFAULT_PREFILL_TPS, cost_model

    cal = tmp_path / "calibration.json"
    cal.write_text(
        json.dumps(
            {
                "prefill_tps": 812.5,
                "decode_tps": 31.2,
                "kv_bytes_per_token": 46080,
                "single_pass_tps": 900.0,
                "prefill_chunk": 512,
                "rows": [{"prefill_tps": 1.0}],
            }
        )
    )
    m = cost_model(None, cal)
    assert (m.prefill_tps, m.decode_tps, m.kv_bytes_per_token, m.source) == (812.5, 31.2, 46080, str(cal))
    assert cost_model(300.0, cal).prefill_tps == 300.0  # the flag wins
    assert cost_model(None, tmp_path / "missing.json").prefill_tps == DEFAULT_PREFILL_TPS


@pytest.mark.parametrize("capacity_blocks,ttl,align", [(60, 3600.0, 16), (10_000, 5.0, 16), (20, 3600.0, 64)])
def test_fingerprint_replay_matches_sha256_match_commit_release(
    tmp_path: Path, capacity_blocks: int, ttl: float, align: int
) -> None:
    """The simulator (fingerprint keys, one ``replay`` call per request) gives every request the
    hit and writes that the engine's path gives: a PrefixCache with real SHA-256 keys driven by
    match, commit and release. Capacity-bound, TTL-bound, and with chunk alignment."""
    from prefixcache.cache import FakeClock, Namespace, PrefixCache

    trace = load_trace(_multi_endpoint_trace(tmp_path / "m.jsonl", endpoints=6, requests=500, sys_tokens=96))
    cfg = SimConfig(capacity_bytes=capacity_blocks * 16, cost=TINY, ttl_s=ttl, align_tokens=align)
    sim = simulate(trace, cfg)
    clock = FakeClock(float(trace.ts[0]))
    cache = PrefixCache(
        block_size=16,
        capacity_bytes=capacity_blocks * 16,
        default_ttl_s=ttl,
        clock=clock,
        pinned_capacity_bytes=0,
    )
    namespaces = [Namespace.create(cfg.fingerprint, tenant=t, salt=f"tenant:{t}") for t in trace.tenants]
    cached, written = [], []
    for i in range(len(trace)):
        clock.set(max(float(trace.ts[i]), clock.now))
        tokens = trace.tokens(i)
        m = cache.match(tokens, namespaces[trace.tenant[i]], align_tokens=align)
        r = cache.commit(m, lambda _j: (None, 16), upto_tokens=(len(tokens) // align) * align)
        cache.release(m)
        cached.append(m.cached_tokens)
        written.append(r.written_tokens)
    assert sim.cached.tolist() == cached
    assert sim.written.tolist() == written
    assert 0 < sim.hit_rate < 1 and sum(written) > 0
    assert sim.replicas[0]["evictions"] == cache.stats().evictions
    assert sum(cache.stats().evictions.values()) > 0  # the cases evict (capacity) or expire (TTL)
