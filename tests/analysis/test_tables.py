"""Reports that fit: at 80 columns, in a file or a pipe, every table cell printed whole (tables
split by columns or stacked, never ``4,6…``), Markdown one line per row, CSV that parses back;
``serve --help`` readable at 80 columns with environment variable names whole."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from analysis_traces import make_trace
from rich.console import Console

import prefixcache
from prefixcache.analysis.report.tables import ReportTable, shorten_left, tables_from_markdown

SRC = str(Path(prefixcache.__file__).resolve().parents[1])
ENDPOINTS = ["/v1/chat/completions", "/v1/messages", "support-assistant-eu-west-production"]


def wide_table() -> ReportTable:
    t = ReportTable(title="Endpoints")
    for col in ("endpoint", "requests", "hit rate", "achievable", "stable prefix", "saving if moved alone"):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for i, name in enumerate(ENDPOINTS):
        t.add_row(
            name, f"{4_600_000 + i:,}", "91.5%", "97.4%", f"{2_000 + i:,}", f"{739_287 * i:,} tok ($2.55)"
        )
    return t


def render(t: ReportTable, width: int, fmt: str = "table") -> str:
    out = io.StringIO()
    t.emit(Console(file=out, width=width, color_system=None), fmt)
    return out.getvalue()


@pytest.mark.parametrize("width", [40, 60, 80, 100, 200])
def test_every_cell_is_printed_whole_within_the_width(width: int) -> None:
    t = wide_table()
    text = render(t, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    flat = " ".join(text.split())  # (a stacked row's long value may wrap at a space)
    for row in t.rows:
        for cell in row:
            assert cell in flat, (cell, text)


def test_a_table_that_fits_is_one_table_and_one_that_does_not_is_split_by_columns() -> None:
    t = wide_table()
    assert render(t, 200).count("Endpoints") == 1
    at_80 = render(t, 80)
    assert "Endpoints (continued)" in at_80
    # Each part leads with the endpoint column, so every row stays readable on its own.
    assert all(at_80.count(name) == 2 for name in ENDPOINTS)


def test_markdown_is_one_line_per_row_and_csv_parses_back() -> None:
    t = wide_table()
    md = render(t, 40, "markdown")
    rows = [line for line in md.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + len(ENDPOINTS)
    assert all(name in md for name in ENDPOINTS)
    parsed = [p for p in tables_from_markdown(md) if isinstance(p, ReportTable)]
    assert [r for r in parsed[0].rows] == t.rows
    text = render(t, 40, "csv")
    assert text.startswith("# Endpoints\n")
    back = list(csv.reader(io.StringIO(text.split("\n", 1)[1])))
    assert back[0] == [h for h, _ in t.columns] and back[1 : 1 + len(t.rows)] == t.rows


def test_shorten_left_keeps_the_end() -> None:
    assert shorten_left("/v1/chat/completions", 12) == "…completions"
    assert shorten_left("/v1/messages", 20) == "/v1/messages"


def run(*args: str, columns: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = SRC
    if columns:
        env["COLUMNS"] = columns
    cmd = [sys.executable, "-m", "prefixcache", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_audit_and_simulate_in_a_pipe_and_at_80_columns(tmp_path: Path) -> None:
    spec = "{}:rate=2,system=400,bust=timestamp"
    trace = make_trace(tmp_path / "t.jsonl", [spec.format(n) for n in ENDPOINTS], 200)
    for args in (["audit", str(trace)], ["simulate", str(trace)]):
        for columns, width in ((None, 100), ("80", 80)):
            r = run(*args, columns=columns)
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert max(len(line) for line in lines) <= width, r.stdout
            assert "…" not in r.stdout
            for name in ENDPOINTS:
                assert name in r.stdout
    md = run("audit", str(trace), "--format", "markdown")
    assert md.returncode == 0 and "| endpoint | requests |" in md.stdout
    out = run("simulate", str(trace), "--format", "csv")
    assert out.returncode == 0 and "# Per endpoint\nendpoint,requests,hit rate" in out.stdout


def test_serve_help_at_80_columns_keeps_every_line_and_env_var_whole() -> None:
    r = run("serve", "--help", columns="80")
    assert r.returncode == 0
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    text = " ".join(r.stdout.split())
    for env in (
        "PREFIXCACHE_API_KEYS_FILE",
        "PREFIXCACHE_SALT_SECRET_FILE",
        "PREFIXCACHE_REDIS_URL_FILE",
        "PREFIXCACHE_DISK_CACHE",
    ):
        assert f"[env var: {env}]" in text
    assert "…" not in r.stdout
