"""The router's exposure rule and connection cap (issue 21, items 1 and 4): ``route`` and
``cluster`` refuse a non-loopback ``--host`` without API keys (as ``serve`` does) unless
``--allow-unauthenticated``; the router's keys gate ``/router/replicas``; ``--max-connections``
caps concurrent connections (503 beyond, before any route runs)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.commands import router_security
from prefixcache.commands.redis_process import free_port

runner = CliRunner()


@pytest.fixture
def no_uvicorn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The router's server replaced by a recorder: proves the command got past its checks."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(router_security, "serve_router", lambda app, **kw: calls.append({"app": app, **kw}))
    monkeypatch.delenv("PREFIXCACHE_API_KEYS", raising=False)
    monkeypatch.delenv("PREFIXCACHE_API_KEYS_FILE", raising=False)
    return calls


@pytest.mark.parametrize("command", [["route", "-r", "http://127.0.0.1:9"], ["cluster", "--no-redis"]])
def test_route_and_cluster_on_all_interfaces_without_keys_refuse(no_uvicorn, command):
    result = runner.invoke(app, [*command, "--host", "0.0.0.0"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Refusing to serve on 0.0.0.0 without API keys" in text
    assert "--allow-unauthenticated" in text
    assert no_uvicorn == []


def test_route_on_all_interfaces_starts_with_keys_or_the_opt_out(no_uvicorn, tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-router-0123456789: alpha\n")
    assert (
        runner.invoke(
            app, ["route", "-r", "http://127.0.0.1:9", "--host", "0.0.0.0", "--api-keys", str(keys)]
        ).exit_code
        == 0
    )
    assert (
        runner.invoke(
            app, ["route", "-r", "http://127.0.0.1:9", "--host", "0.0.0.0", "--allow-unauthenticated"]
        ).exit_code
        == 0
    )
    assert runner.invoke(app, ["route", "-r", "http://127.0.0.1:9", "--max-connections", "7"]).exit_code == 0
    assert [c["host"] for c in no_uvicorn] == ["0.0.0.0", "0.0.0.0", "127.0.0.1"]
    assert [c["max_connections"] for c in no_uvicorn] == [1024, 1024, 7]
    assert no_uvicorn[0]["secrets"] == ["sk-router-0123456789"]
    assert no_uvicorn[0]["app"].state.router is not None


def test_route_caps_connections_and_gates_the_replica_list(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-router-0123456789: alpha\n")
    port = free_port()
    cmd = [sys.executable, "-m", "prefixcache", "route", "-r", "http://127.0.0.1:9", "--port", str(port)]
    cmd += ["--api-keys", str(keys), "--max-connections", "3", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_API_KEYS")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the router did not start"
                time.sleep(0.1)
        assert httpx.get(url + "/router/replicas", timeout=5).status_code == 401
        good = {"authorization": "Bearer sk-router-0123456789"}
        assert httpx.get(url + "/router/replicas", headers=good, timeout=5).status_code == 200
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            time.sleep(0.3)  # the server has accepted them
            assert httpx.get(url + "/health", timeout=5).status_code == 503
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 10
        while httpx.get(url + "/router/replicas", headers=good, timeout=5).status_code == 503:
            assert time.monotonic() < deadline, "closed connections were not released"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
