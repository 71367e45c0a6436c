"""Tests that cannot lie (issue 11, item 9): a binary the suite needs (redis-server, chromium)
that is missing skips its tests on a laptop but fails them under CI, so a CI run that tested
none of the shared tier is red, not green."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def test_a_missing_binary_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, require_binary: Callable[[str, str], str]
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(
        pytest.fail.Exception, match=r"no-such-binary-0x1f is not on PATH.*apt-get install it"
    ):
        require_binary("no-such-binary-0x1f", "apt-get install it")


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_a_missing_binary_skips_outside_ci(
    monkeypatch: pytest.MonkeyPatch, require_binary: Callable[[str, str], str], ci: str | None
) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="no-such-binary-0x1f"):
        require_binary("no-such-binary-0x1f", "apt-get install it")


def test_a_present_binary_is_found(require_binary: Callable[[str, str], str]) -> None:
    assert Path(require_binary("sh", "")).name == "sh"


def test_a_ci_run_without_redis_server_on_the_path_is_red(tmp_path: Path) -> None:
    """The real thing: pytest on a Redis test, with CI set and redis-server off the PATH."""
    target = f"{TESTS / 'scaleout' / 'test_tiers.py'}::test_redis_killed_mid_run_every_request_still_succeeds"
    env = {**os.environ, "CI": "1", "PATH": str(tmp_path)}  # an empty directory: no redis-server
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=TESTS.parent,
    )
    assert run.returncode == 1, run.stdout[-2000:]
    assert "redis-server is not on PATH" in run.stdout and "1 error" in run.stdout, run.stdout[-2000:]
