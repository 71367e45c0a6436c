"""The CLI end to end: synth -> audit (--json, --html) -> simulate (--sweep, --plot, --keep-warm)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache.cli import app

runner = CliRunner()


def _ok(args: list[str]) -> str:
    res = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output + repr(res.exception)
    return res.stdout


@pytest.fixture(scope="module")
def cli_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("cli") / "t.jsonl"
    _ok(
        [
            "trace",
            "synth",
            str(p),
            "-n",
            "400",
            "--seed",
            "2",
            "-e",
            "web:rate=3,system=700",
            "-e",
            "api:rate=1,system=500,bust=uuid",
            "-e",
            "cron:rate=0.05,system=600",
        ]
    )
    return p


def test_help_lists_every_option() -> None:
    out = _ok(["simulate", "--help"])
    for flag in (
        "--ttl",
        "--capacity",
        "--block-size",
        "--replicas",
        "--routing",
        "--keep-warm",
        "--prefill-tps",
        "--pricing",
        "--sweep",
        "--json",
        "--plot",
    ):
        assert flag in out
    out = _ok(["audit", "--help"])
    for flag in ("--html", "--json", "--ttl", "--tokenizer"):
        assert flag in out
    assert "synth" in _ok(["trace", "--help"])


def test_audit_json_finds_the_planted_uuid(cli_trace: Path) -> None:
    d = json.loads(_ok(["audit", str(cli_trace), "--json"]))
    rows = {e["endpoint"]: e for e in d["endpoints"]}
    assert [b["kind"] for b in rows["api"]["busting"]] == ["uuid"]
    assert rows["web"]["busting"] == [] and rows["web"]["hit_rate"] > 0.8


def test_simulate_sweep_json_and_plot(cli_trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    d = json.loads(
        _ok(
            [
                "simulate",
                str(cli_trace),
                "--sweep",
                "ttl=10,60,600",
                "--json",
                "--plot",
                str(png),
                "--prefill-tps",
                "500",
            ]
        )
    )
    rates = [r["hit_rate"] for r in d["results"]]
    assert rates == sorted(rates) and rates[0] < rates[-1]  # longer TTL, more hits (unbounded here)
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_tables_replicas_and_keep_warm_auto(cli_trace: Path) -> None:
    out = _ok(
        [
            "simulate",
            str(cli_trace),
            "--replicas",
            "3",
            "--routing",
            "cache-aware",
            "--keep-warm",
            "auto",
            "--ttl",
            "10",
        ]
    )
    assert "hit rate" in out and "Per replica" in out and "anthropic" in out
    assert "keep-warm (auto): cron" in out


def test_simulate_rejects_unknown_routing(cli_trace: Path) -> None:
    res = runner.invoke(app, ["simulate", str(cli_trace), "--routing", "nearest"])
    assert res.exit_code != 0 and "round-robin" in res.output


def test_html_report_renders_in_headless_chromium(cli_trace: Path, tmp_path: Path, chromium_bin: str) -> None:
    from PIL import Image

    html = tmp_path / "report.html"
    _ok(["audit", str(cli_trace), "--html", str(html)])
    shot = tmp_path / "shot.png"
    cmd = [
        chromium_bin,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,2000",
        html.resolve().as_uri(),
    ]
    env = {**os.environ, "HOME": str(tmp_path)}
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=env)
    assert shot.is_file() and shot.stat().st_size > 10_000
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 2000)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 50  # text, tables and plots: far from one flat colour
