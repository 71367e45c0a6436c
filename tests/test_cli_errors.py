"""Every command given a bad option or file answers one line on stderr naming the option and what
to write, exit status 2, no traceback (the installed entry point, run as a user runs it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import prefixcache

SRC = str(Path(prefixcache.__file__).resolve().parents[1])


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env["PYTHONPATH"] = SRC
    env["COLUMNS"] = "80"
    cmd = [sys.executable, "-m", "prefixcache", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "t.jsonl"
    r = run("trace", "synth", str(path), "-n", "40")
    assert r.returncode == 0, r.stderr
    return path


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


T = "{trace}"
CASES: list[tuple[list[str], str, str]] = [
    # (argv, the option blamed, words of the fix)
    (["simulate", T, "--capacity", "1PiB"], "--capacity", "16GiB"),
    (["simulate", T, "--ttl", "5x"], "--ttl", "5m"),
    (["simulate", T, "--sweep", "ttl=a,b"], "--sweep", "5m"),
    (["simulate", T, "--sweep", "replicas=0,2"], "--sweep", "whole numbers"),
    (["simulate", T, "--sweep", "color=1,2"], "--sweep", "ttl=60,300"),
    (["simulate", T, "--replicas", "0"], "--replicas", "1"),
    (["simulate", T, "--keep-warm", "nofile"], "--keep-warm", "nofile"),
    (["simulate", T, "--sweep", "ttl=60,300", "--plot", "/etc/hostname/x.png"], "--plot", "is not a folder"),
    (["audit", T, "--plots", "/etc/hostname/plots"], "--plots", "cannot create the folder"),
    (["simulate", T, "--block-size", "0"], "--block-size", "1"),
    (["audit", T, "--pricing", "foo"], "--pricing", "anthropic"),
    (["audit", T, "--ttl", "0"], "--ttl", "above 0"),
    (["audit", T, "--html", "/missing/x.html"], "--html", "/missing"),
    (["audit", T, "--block-size", "0"], "--block-size", "1"),
    (["audit", "/missing/trace.jsonl"], "TRACE", "/missing/trace.jsonl"),
    (["trace", "synth", "/missing/dir/x.jsonl", "-n", "5"], "OUT", "/missing/dir"),
    (["route", "--replica", "notaurl"], "--replica", "http://"),
    (["serve", "--ttl", "5x"], "--ttl", "5m"),
    (["cluster", "--ttl", "forever"], "--ttl", "5m"),
    (["bench", "--lengths", "a,b"], "--lengths", "256,512"),
    (["cache", "gc", "/missing/dir"], "DIRECTORY", "/missing/dir"),
]


def check_one_line(r: subprocess.CompletedProcess[str], blamed: str, fix: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("prefixcache ") and blamed in lines[0] and fix in lines[0], lines[0]


def test_every_bad_input_is_one_line_and_exit_2(trace: Path) -> None:
    def one(case: tuple[list[str], str, str]) -> tuple[list[str], subprocess.CompletedProcess[str]]:
        argv = [a.replace(T, str(trace)) for a in case[0]]
        return argv, run(*argv)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, CASES))
    for (argv, r), (_, blamed, fix) in zip(results, CASES, strict=True):
        try:
            check_one_line(r, blamed, fix)
        except AssertionError as e:
            raise AssertionError(f"prefixcache {' '.join(argv)}: {e}") from None


def test_a_taken_port_fails_before_any_model_loads(taken_port: int) -> None:
    # serve: --ttl 5m is accepted (as audit's is): what fails is the port, before the model loads.
    r = run("serve", "--ttl", "5m", "--port", str(taken_port), timeout=60)
    check_one_line(r, "--port", "already in use")
    r = run("cluster", "--no-redis", "--port", str(taken_port), timeout=60)
    check_one_line(r, "--port", "already in use")
    r = run("route", "--replica", "http://127.0.0.1:9", "--port", str(taken_port), timeout=60)
    check_one_line(r, "--port", "already in use")


def test_version_and_good_durations() -> None:
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"prefixcache {prefixcache.__version__}"
    from prefixcache.analysis.costs import parse_duration, parse_size

    assert [parse_duration(t) for t in ("300", "90s", "5m", "1h", "1.5d")] == [300, 90, 300, 3600, 129600]
    assert [parse_size(t) for t in ("2GiB", "512MB", "1e9", "16k")] == [2 << 30, 512 * 10**6, 10**9, 16000]
    for bad in ("1PiB", "-1GiB", "nan", "", "GiB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    for bad in ("5x", "0", "-5m", "inf", "m"):
        with pytest.raises(ValueError, match="is not a duration"):
            parse_duration(bad)
