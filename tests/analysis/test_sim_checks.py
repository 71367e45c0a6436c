"""The simulator says when its answer is meaningless (a replica offered more prefill than it can
do) or costly (an endpoint whose reuse is below the write surcharge's break-even)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from prefixcache.analysis.costs import CostModel, break_even_reuse
from prefixcache.analysis.simulate import SimConfig, simulate
from prefixcache.analysis.trace import TraceWriter, load_trace
from prefixcache.cli import app


def _unique_prompts(path: Path, n: int = 20, tokens: int = 1000) -> Path:
    """``n`` requests one second apart, each a distinct prompt: nothing hits, all is prefilled."""
    rng = np.random.default_rng(0)
    with TraceWriter(path) as w:
        for i in range(n):
            w.request(float(i), endpoint="e", tokens=rng.integers(0, 50_000, tokens).tolist())
    return path


def test_an_overloaded_replica_is_reported_saturated_and_its_ttft_not_meaningful(tmp_path: Path) -> None:
    trace = load_trace(_unique_prompts(tmp_path / "u.jsonl"))
    res = simulate(trace, SimConfig(cost=CostModel(prefill_tps=100.0)))
    # 20 x 1,000 uncached tokens at 100 tok/s = 200 s of prefill over a 19 s span.
    [replica] = res.replicas
    assert replica["offered_prefill_s"] == 200.0
    assert replica["utilisation"] == pytest.approx(200 / 19, rel=1e-12)
    assert replica["saturated"] is True
    d = res.as_dict()
    assert d["load"]["saturated"] is True and d["load"]["max_utilisation"] == replica["utilisation"]
    assert "1053% of their prefill capacity" in d["load"]["warning"]
    assert "not meaningful" in d["load"]["warning"]
    assert d["ttft_s"]["meaningful"] is False
    assert d["endpoints"][0]["ttft_s"]["meaningful"] is False
    # Two replicas at 10,000 tok/s: each is offered 10 s over 19 s.
    ok = simulate(trace, SimConfig(replicas=2, cost=CostModel(prefill_tps=10_000.0))).as_dict()
    assert [r["utilisation"] for r in ok["replicas"]] == pytest.approx([1 / 19, 1 / 19], rel=1e-12)
    assert ok["load"]["saturated"] is False and ok["load"]["warning"] is None
    assert ok["ttft_s"]["meaningful"] is True


def test_cli_table_and_json_say_saturated_and_take_a_named_profile(tmp_path: Path) -> None:
    path = _unique_prompts(tmp_path / "u.jsonl")
    runner = CliRunner()
    table = runner.invoke(app, ["simulate", str(path), "--prefill-tps", "100"], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "SATURATED, not meaningful" in table.output and "1052.6%" in table.output
    assert "warning:" in table.output
    out = runner.invoke(
        app,
        [
            "simulate",
            str(path),
            "--json",
            "--prefill-tps",
            "smollm2-135m-cpu",
            "--kv-bytes-per-token",
            "llama3-8b",
        ],
    )
    assert out.exit_code == 0, out.output
    d = json.loads(out.stdout)
    assert d["config"]["prefill_tps"] == 212.3
    assert d["config"]["prefill_tps_source"].startswith("profile smollm2-135m-cpu (measured")
    assert d["config"]["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    bad = runner.invoke(app, ["simulate", str(path), "--prefill-tps", "h100"])
    assert bad.exit_code == 2 and "unknown hardware profile 'h100'" in bad.output
    kv_only = runner.invoke(app, ["simulate", str(path), "--prefill-tps", "llama3-8b"])
    assert kv_only.exit_code == 2 and "has no prefill figure" in kv_only.output


def test_an_endpoint_reused_below_the_break_even_is_flagged_as_losing_money(tmp_path: Path) -> None:
    # 33-token prompts: two full blocks (32 tokens) are cacheable and a hit can read both.
    rng = np.random.default_rng(1)
    distinct = [rng.integers(0, 50_000, 33).tolist() for _ in range(10)]
    shared = rng.integers(0, 50_000, 33).tolist()
    with TraceWriter(tmp_path / "b.jsonl") as w:
        t = 0.0
        for prompt in [*distinct, distinct[0]]:  # loser: 10 writes of 32, one read of 32
            w.request(t, endpoint="loser", tokens=prompt)
            t += 1
        for _ in range(5):  # winner: one write of 32, four reads of 32
            w.request(t, endpoint="winner", tokens=shared)
            t += 1
    res = simulate(load_trace(tmp_path / "b.jsonl"), SimConfig())
    rows = {r["profile"]: r for r in res.as_dict()["break_even"]}
    anthropic = rows["anthropic"]
    assert anthropic["break_even_reuse"] == pytest.approx(5 / 23, abs=1e-15)  # (1.25-1)/(1.25-0.1)
    assert anthropic["break_even_reuse_1h"] == pytest.approx(1 / 1.9, abs=1e-15)  # (2-1)/(2-0.1)
    assert anthropic["losing_endpoints"] == ["loser"]
    loser, winner = anthropic["endpoints"]
    assert loser["reuse_probability"] == 32 / 352 and loser["loses_money"] is True
    assert loser["break_even_reuse"] == pytest.approx(5 / 23, abs=1e-15)
    # 320 written tokens at +0.25, 32 read at -0.9, at $3 per million.
    assert loser["extra_input_usd"] == pytest.approx((320 * 0.25 - 32 * 0.9) * 3e-6, rel=1e-12)
    assert winner["reuse_probability"] == 128 / 160 and winner["loses_money"] is False
    assert winner["extra_input_usd"] < 0
    # No write surcharge: caching never costs more.
    assert rows["openai"]["break_even_reuse"] == 0.0 and rows["openai"]["losing_endpoints"] == []
    assert rows["self-hosted"]["losing_endpoints"] == []
    assert break_even_reuse(1.25, 0.1) == 0.25 / 1.15
