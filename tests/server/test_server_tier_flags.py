"""``prefixcache serve``'s tier flags: the Redis URL from a file or the environment instead of argv
(a password on argv is warned about, never logged), the Redis TTL cap, the per-tenant pin share,
and one salt secret for the tenant salts and the tier entries' MAC key; and what the exposure
rule hands the app and uvicorn (the connection cap, whose prompt text callers see)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

from prefixcache.cache import PrefixCache
from prefixcache.cli import app

runner = CliRunner()


class _CacheOnlyEngine:
    """No model: a real cache, enough for ``serve`` to attach tiers and build the app."""

    context_len = 2048
    fingerprint = "stub"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cache = PrefixCache(block_size=16)

    def close(self) -> None:
        pass


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Runs ``serve`` up to the point it would listen; returns what reached ``attach_tiers``
    and ``create_app``."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr("prefixcache.engine.Engine", _CacheOnlyEngine)
    import prefixcache.server.build as build  # where serve's config is wired

    monkeypatch.setattr(build, "attach_tiers", lambda cache, **kw: seen.update(tiers=kw) or [])
    real_create_app = build.create_app

    def create_app(engine: Any, **kw: Any) -> Any:
        seen["app"] = kw
        return real_create_app(engine, **kw)

    monkeypatch.setattr(build, "create_app", create_app)

    def run(self: uvicorn.Server) -> None:
        seen["uvicorn"] = self.config
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    for var in ("PREFIXCACHE_REDIS_URL", "PREFIXCACHE_REDIS_URL_FILE", "PREFIXCACHE_SALT_SECRET"):
        monkeypatch.delenv(var, raising=False)
    for var in ("PREFIXCACHE_API_KEYS", "PREFIXCACHE_API_KEYS_FILE"):
        monkeypatch.delenv(var, raising=False)
    return seen


def test_serve_caps_connections_and_shows_no_cached_text_on_an_exposed_address_without_keys(
    served, tmp_path: Path
) -> None:
    exposed = ["serve", "--host", "0.0.0.0", "--allow-unauthenticated"]
    res = runner.invoke(app, [*exposed, "--max-connections", "5"])
    assert res.exit_code == 0, res.output
    assert served["uvicorn"].limit_concurrency == 5  # a 503 past 5 connections, before any route
    assert served["app"]["caller_text"] == "none"  # nothing tells callers apart: no cached-side text
    res = runner.invoke(app, ["serve"])  # loopback, no keys: the single user sees everything
    assert res.exit_code == 0, res.output
    assert served["uvicorn"].limit_concurrency == 1024 and served["app"]["caller_text"] is None
    assert served["app"]["api_keys"] is None
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha-0123456789: alpha\n")
    res = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--api-keys", str(keys)])
    assert res.exit_code == 0, res.output
    assert served["app"]["caller_text"] is None and served["app"]["api_keys"]  # keys: each its own text


def test_redis_url_from_a_file_with_the_ttl_cap_and_pin_share(served, tmp_path: Path, caplog) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text("redis://:file-password-123@127.0.0.1:6390/0\n")
    secret_file = tmp_path / "salt"
    secret_file.write_text("the-salt-secret-of-a-deployment\n")
    caplog.set_level(logging.INFO)
    args = ["serve", "--redis-url-file", str(url_file), "--salt-secret-file", str(secret_file)]
    res = runner.invoke(app, [*args, "--redis-max-ttl", "600", "--tenant-pin-share", "0.25"])
    assert res.exit_code == 0, res.output
    tiers = served["tiers"]
    assert tiers["redis_url"] == "redis://:file-password-123@127.0.0.1:6390/0"
    assert tiers["redis_max_ttl_s"] == 600.0
    assert tiers["secret"] == b"the-salt-secret-of-a-deployment" == served["app"]["salt_secret"]
    assert served["app"]["tenant_pin_share"] == 0.25
    assert "file-password-123" not in caplog.text + res.output


def test_redis_url_given_twice_or_unreadable_is_a_usage_error(served, tmp_path: Path) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text("redis://127.0.0.1:6390/0")
    res = runner.invoke(app, ["serve", "--redis-url-file", str(url_file), "--redis", "redis://x:1/0"])
    assert res.exit_code == 2 and "give the Redis URL once" in res.output
    res = runner.invoke(app, ["serve", "--redis-url-file", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "cannot read the Redis URL file" in res.output
    res = runner.invoke(app, ["serve", "--redis-max-ttl", "0"])
    assert res.exit_code == 2 and "--redis-max-ttl" in res.output
    res = runner.invoke(app, ["serve", "--tenant-pin-share", "0"])
    assert res.exit_code == 2 and "--tenant-pin-share" in res.output


def test_redis_url_from_the_environment_and_a_warning_for_a_password_on_argv(
    served, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv("PREFIXCACHE_REDIS_URL", "redis://:env-password-456@127.0.0.1:6391/0")
    caplog.set_level(logging.INFO)
    res = runner.invoke(app, ["serve"])
    assert res.exit_code == 0, res.output
    assert served["tiers"]["redis_url"] == "redis://:env-password-456@127.0.0.1:6391/0"
    assert served["tiers"]["redis_max_ttl_s"] == 3600.0
    assert "visible to every local user" not in caplog.text
    monkeypatch.delenv("PREFIXCACHE_REDIS_URL")
    res = runner.invoke(app, ["serve", "--redis", "redis://:argv-password-789@127.0.0.1:6392/0"])
    assert res.exit_code == 0, res.output
    assert "--redis with a password on the command line is visible to every local user" in caplog.text
    assert "argv-password-789" not in caplog.text
    # Without a salt secret: one random secret, the same for the salts and the tier MAC.
    assert isinstance(served["tiers"]["secret"], bytes) and len(served["tiers"]["secret"]) == 32
    assert served["tiers"]["secret"] == served["app"]["salt_secret"]
