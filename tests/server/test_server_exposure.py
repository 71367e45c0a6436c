"""No keys, no exposure (issue 11, item 6): ``prefixcache serve`` on a non-loopback host without
API keys refuses to start unless ``--allow-unauthenticated``; secrets come from a file or the
environment instead of argv, and never reach a log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.server.exposure import (
    RedactSecrets,
    api_keys_from_env,
    exposure_refusal,
    install_redaction,
    is_loopback,
    read_secret_file,
)

runner = CliRunner()
SENTINEL = "engine-construction-reached"


class _NoEngine:
    """Stands in for the Engine: proves the exposure check let ``serve`` through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError(SENTINEL)


class _StubEngine:
    """An engine with no model and no cache: enough for ``create_app``."""

    cache = None
    context_len = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefixcache.engine.Engine", _NoEngine)
    for var in (
        "PREFIXCACHE_API_KEYS",
        "PREFIXCACHE_API_KEYS_FILE",
        "PREFIXCACHE_SALT_SECRET",
        "PREFIXCACHE_SALT_SECRET_FILE",
        "PREFIXCACHE_REDIS_URL",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts(host):
    assert is_loopback(host) and exposure_refusal(host, has_keys=False, allow_unauthenticated=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.com", "my-host"])
def test_exposed_hosts_need_keys_or_an_explicit_opt_out(host):
    assert not is_loopback(host)
    message = exposure_refusal(host, has_keys=False, allow_unauthenticated=False)
    assert message is not None and "cached_tokens" in message and "--allow-unauthenticated" in message
    assert exposure_refusal(host, has_keys=True, allow_unauthenticated=False) is None
    assert exposure_refusal(host, has_keys=False, allow_unauthenticated=True) is None


def test_serve_on_all_interfaces_without_keys_refuses_before_loading_the_model(no_engine):
    res = runner.invoke(app, ["serve", "--host", "0.0.0.0"])
    assert res.exit_code == 2, res.output
    assert "Refusing to serve on 0.0.0.0 without API keys" in res.output
    assert "cached_tokens" in res.output and SENTINEL not in res.output


@pytest.mark.parametrize("how", ["flag", "key-file", "key-file-env", "keys-env"])
def test_serve_on_all_interfaces_starts_with_keys_or_the_opt_out(no_engine, monkeypatch, tmp_path, how):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alpha-0123456789: alpha\n")
    args = ["serve", "--host", "0.0.0.0"]
    if how == "flag":
        args.append("--allow-unauthenticated")
    elif how == "key-file":
        args += ["--api-keys", str(keys)]
    elif how == "key-file-env":
        monkeypatch.setenv("PREFIXCACHE_API_KEYS_FILE", str(keys))
    else:
        monkeypatch.setenv("PREFIXCACHE_API_KEYS", "sk-alpha-0123456789: alpha")
    res = runner.invoke(app, args)
    assert SENTINEL in res.output, res.output  # past the check, at the engine


def test_api_keys_from_the_environment():
    assert api_keys_from_env({"PREFIXCACHE_API_KEYS": '{"k-123456": "t"}'}) == {"k-123456": "t"}
    two = {"a-key": "t1", "b-key": "t2"}
    assert api_keys_from_env({"PREFIXCACHE_API_KEYS": "a-key: t1\nb-key: t2"}) == two
    assert api_keys_from_env({}) is None
    with pytest.raises(ValueError, match=r"\$PREFIXCACHE_API_KEYS:1: expected 'key: tenant'") as e:
        api_keys_from_env({"PREFIXCACHE_API_KEYS": "sk-secret-but-no-tenant"})
    assert "sk-secret" not in str(e.value)  # an error never quotes a key


def test_salt_secret_file(no_engine, tmp_path):
    path = tmp_path / "salt"
    path.write_text("the-salt-secret-of-this-test\n")
    assert read_secret_file(path, "salt secret") == "the-salt-secret-of-this-test"
    (tmp_path / "empty").write_text("\n")
    res = runner.invoke(app, ["serve", "--salt-secret-file", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "is empty" in res.output
    res = runner.invoke(app, ["serve", "--salt-secret-file", str(path), "--salt-secret", "also"])
    assert res.exit_code == 2 and "once" in res.output
    res = runner.invoke(app, ["serve", "--salt-secret-file", str(path)])
    assert SENTINEL in res.output


def test_redaction_covers_messages_arguments_and_tracebacks():
    stream_records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stream_records.append(self.format(record))

    logger = logging.getLogger("prefixcache.test.redaction")
    handler = ListHandler()
    logger.addHandler(handler)
    try:
        redactor = install_redaction(RedactSecrets(["sk-live-0123456789", "hunter2-pass", "ab"]))
        install_redaction(redactor)  # idempotent
        assert handler.filters.count(redactor) == 1
        logger.warning("key %s rejected", "sk-live-0123456789")
        logger.warning("grab a cab")
        logger.warning("cache tier: redis redis://:hunter2-pass@10.0.0.2:6379/0")
        try:
            raise RuntimeError("connect to redis://:hunter2-pass@host failed")
        except RuntimeError:
            logger.exception("tier failed")
    finally:
        logger.removeHandler(handler)
    text = "\n".join(stream_records)
    assert "sk-live" not in text and "hunter2" not in text
    assert text.count("***") == 4  # the traceback quotes the secret twice: its source line and message
    assert "grab a cab" in text  # "ab" is too short to redact


def test_serve_keeps_secrets_out_of_every_log(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr("prefixcache.engine.Engine", _StubEngine)
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-live-0123456789: alpha\n")
    salt = tmp_path / "salt"
    salt.write_text("salt-secret-abcdef\n")
    redis_url = "redis://:hunter2-pass@10.0.0.2:6379/0"

    def run(self: uvicorn.Server) -> None:  # what a tier and uvicorn might log while serving
        logging.getLogger("prefixcache.cache.tiers").info("cache tier: redis %s", redis_url)
        logging.getLogger("uvicorn.error").error(
            "bad key %s (salt %s)", "sk-live-0123456789", "salt-secret-abcdef"
        )
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr("prefixcache.server.build.attach_tiers", lambda *a, **k: [])
    caplog.set_level(logging.INFO)
    res = runner.invoke(
        app,
        [
            "serve",
            "--host",
            "0.0.0.0",
            "--api-keys",
            str(keys),
            "--salt-secret-file",
            str(salt),
            "--redis",
            redis_url,
        ],
    )
    assert res.exit_code == 0, res.output
    shown = caplog.text + res.output
    assert "cache tier: redis redis://:***@10.0.0.2" in caplog.text
    assert "bad key *** (salt ***)" in res.output  # uvicorn's own handler, set up inside serve
    for secret in ("sk-live-0123456789", "salt-secret-abcdef", "hunter2-pass"):
        assert secret not in shown


def test_a_salt_secret_on_the_command_line_is_warned_about(no_engine, caplog):
    res = runner.invoke(app, ["serve", "--salt-secret", "visible-in-ps-to-all-users"])
    assert SENTINEL in res.output
    assert "visible to every local user" in caplog.text and "visible-in-ps" not in caplog.text


def test_keys_only_and_text_traces_are_exclusive(no_engine, tmp_path: Path):
    args = ["serve", "--trace-log", str(tmp_path / "t"), "--trace-text", "--trace-keys-only"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "--trace-keys-only" in res.output
