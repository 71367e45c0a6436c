"""The redis-server ``prefixcache cluster`` starts: capped by maxmemory, evicting by its policy,
password-protected with the password in no argv (and, in test_cluster_e2e, in no log)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from prefixcache.commands.redis_process import free_port, redacted_url, redis_password_from, start_redis


def test_the_started_redis_is_capped_evicts_lru_and_needs_its_password(
    tmp_path: Path, redis_server_bin: str
) -> None:
    password = "pw-" + "x" * 40
    proc, url = start_redis(
        redis_server_bin, str(tmp_path), maxmemory=8 << 20, policy="allkeys-lru", password=password
    )
    try:
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(url) as client:
            assert client.config_get("maxmemory") == {"maxmemory": str(8 << 20)}
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
            block = b"k" * (64 << 10)
            for i in range(400):  # 25 MiB of 64 KiB blocks into 8 MiB: writes never fail, LRU goes
                client.set(f"block:{i}", block, ex=3600)
            kept = client.dbsize()  # Redis may go on evicting in the background: no exact sum
            assert client.info("stats")["evicted_keys"] >= 400 - kept > 0
            assert kept * (64 << 10) <= 8 << 20
            assert client.exists("block:399") == 1  # (LRU clock: 1 s; which old ones went is random)
            assert client.info("memory")["used_memory"] <= (8 << 20) * 1.05
    finally:
        proc.kill()
        proc.wait(5)


def test_redis_urls_are_logged_without_their_password(tmp_path: Path) -> None:
    assert redacted_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redacted_url("redis://user:s3cret@h/1") == "redis://user:***@h/1"
    assert redacted_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert len(redis_password_from(None)) >= 32 and redis_password_from(None) != redis_password_from(None)
    good = tmp_path / "pw"
    good.write_text("hunter2-long-enough\n")
    assert redis_password_from(good) == "hunter2-long-enough"


def test_cluster_refuses_an_unknown_eviction_policy_or_a_bad_password_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from prefixcache.cli import app

    def said(output: str) -> str:  # rich wraps the message in a box
        return " ".join(output.replace("│", " ").split())

    res = CliRunner().invoke(app, ["cluster", "--redis-maxmemory-policy", "lru"])
    assert res.exit_code == 2 and "'lru' is not a Redis eviction policy" in said(res.output)
    bad = tmp_path / "pw"
    bad.write_text("two words\n")
    res = CliRunner().invoke(app, ["cluster", "--redis-password-file", str(bad)])
    assert res.exit_code == 2 and "without spaces, quotes or backslashes" in said(res.output)


def test_a_free_port_is_free_and_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ports the cluster hands its children (redis-server, replicas, KV event sockets) come
    from below the range the kernel draws bind(0) and outgoing connections from, so no other
    socket is given one between the pick and the child's bind; a port in use is skipped."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1  # spread, not one fixed port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        held, other = taken.getsockname()[1], free_port()
        assert other != held
        draws = iter([held, held, other])
        monkeypatch.setattr(random, "randrange", lambda *_: next(draws))
        assert free_port() == other  # the held port drawn twice, refused twice
