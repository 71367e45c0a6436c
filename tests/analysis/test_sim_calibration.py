"""The simulator independent of the working directory: the calibration shipped in the package,
or the one ``prefixcache bench`` left in ``$PREFIXCACHE_HOME``; the KV bytes per token a server's
trace header records (its KV dtype) used for the cache's size; saturation flagged in sweeps, in
the table and on the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from analysis_traces import make_trace

import prefixcache
from prefixcache.analysis.costs import cost_model, shipped_calibration
from prefixcache.analysis.report import plot_sweep
from prefixcache.analysis.simulate import SimConfig, simulate
from prefixcache.analysis.trace import load_trace
from prefixcache.cache.tiers import BlockLayout
from prefixcache.server.ops.tracelog import TraceLog, engine_header

SRC = str(Path(prefixcache.__file__).resolve().parents[1])
SHIPPED = json.loads(shipped_calibration().read_text())


def simulate_json(trace: Path, cwd: Path, home: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": SRC, "PREFIXCACHE_HOME": str(home)}
    cmd = [sys.executable, "-m", "prefixcache", "simulate", str(trace), "--json", *args]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_answer_does_not_depend_on_the_working_directory(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "t.jsonl", ["ep:rate=2,system=400"], 100)
    repo = Path(SRC).parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    home = tmp_path / "home"
    a = simulate_json(trace, repo, home)["config"]
    b = simulate_json(trace, elsewhere, home)["config"]
    assert a == b
    assert a["prefill_tps"] == SHIPPED["prefill_tps"] and "shipped calibration" in a["prefill_tps_source"]
    # What `prefixcache bench` measured on this machine wins, from any directory.
    home.mkdir()
    (home / "calibration.json").write_text(json.dumps({"prefill_tps": 1234.5, "kv_bytes_per_token": 23040}))
    c = simulate_json(trace, elsewhere, home)["config"]
    assert (c["prefill_tps"], c["prefill_tps_source"]) == (1234.5, str(home / "calibration.json"))
    assert c["kv_bytes_per_token"] == 23040


class _Engine:
    block_layout = BlockLayout(shape=(30, 2, 3, 16, 64), dtype="bfloat16")


def test_a_server_trace_header_records_the_kv_dtype_and_simulate_sizes_the_cache_with_it(
    tmp_path: Path,
) -> None:
    header = engine_header(_Engine())
    assert header == {"dtype": "bfloat16", "kv_bytes_per_token": 2 * 30 * 3 * 64 * 2, "block_size": 16}
    path = tmp_path / "server.jsonl"
    TraceLog(path, tokenizer="bytes", header=header).close()
    first = json.loads(path.read_text().splitlines()[0])
    assert first["dtype"] == "bfloat16" and first["kv_bytes_per_token"] == 23040
    # A trace with that header (requests appended) is simulated at 23,040 bytes per token.
    body = make_trace(tmp_path / "t.jsonl", ["ep:rate=2,system=400"], 50).read_text().splitlines()
    lines = [json.dumps({**json.loads(body[0]), **header})] + body[1:]
    path.write_text("\n".join(lines) + "\n")
    got = simulate_json(path, tmp_path, tmp_path / "home")["config"]
    assert (got["kv_bytes_per_token"], got["kv_bytes_per_token_source"]) == (23040, "trace header (bfloat16)")
    flag = simulate_json(path, tmp_path, tmp_path / "home", "--kv-bytes-per-token", "46080")["config"]
    assert flag["kv_bytes_per_token"] == 46080


def test_saturation_is_flagged_in_the_sweep_table_and_plot(tmp_path: Path) -> None:
    trace = make_trace(tmp_path / "t.jsonl", ["ep:rate=20,system=2000"], 300)
    env = {**os.environ, "PYTHONPATH": SRC, "PREFIXCACHE_HOME": str(tmp_path / "home"), "COLUMNS": "120"}
    cmd = [sys.executable, "-m", "prefixcache", "simulate", str(trace), "--sweep", "ttl=1,300"]
    cmd += ["--prefill-tps", "500", "--plot", str(tmp_path / "s.png")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "(saturated)" in r.stdout and "saturated at ttl=1" in " ".join(r.stdout.split())
    assert (tmp_path / "s.png").stat().st_size > 0
    tr = load_trace(trace)
    results = [simulate(tr, SimConfig(ttl_s=t, cost=cost_model(500.0))) for t in (1.0, 300.0)]
    meaningful = [r.as_dict()["ttft_s"]["meaningful"] for r in results]
    assert meaningful[0] is False
    fig = plot_sweep("ttl", ["1", "300"], [1.0, 300.0], results)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "saturated: TTFT not meaningful" in labels
