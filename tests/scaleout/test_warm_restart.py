"""Warm restarts by default: the salt secret kept 0600 in the disk tier's directory (a wider mode
refused, an explicit secret winning), the namespaces of other secrets found and reclaimed by
``prefixcache cache gc``, and a real ``serve`` subprocess warm after a restart with no secret given."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from typer.testing import CliRunner

import prefixcache
from prefixcache.cache import Namespace, PrefixCache
from prefixcache.cache.tiers import DiskTier, TensorCodec, flush_tiers
from prefixcache.cache.tiers.persisted import (
    SecretFileError,
    persisted_secret,
    read_persisted_secret,
    scan_namespaces,
    stale_namespaces,
)
from prefixcache.cli import app
from prefixcache.commands.warm import disk_secret

from .conftest import free_port, stop_process_tree, wait_http

B = 4
SHAPE = (2, 2, 1, B, 3)
NS = Namespace.create("tiny|float32|B4|kv1", tenant="a", salt=b"salt-a")
PROMPT = list(range(100, 121))  # 5 full blocks


def fill(directory: Path, secret: str, prompt: list[int] = PROMPT) -> DiskTier:
    """A cache whose disk tier under ``directory`` is keyed from ``secret``, one prompt committed."""
    cache = PrefixCache(block_size=B, capacity_bytes=1 << 20)
    disk = DiskTier(directory, codec=TensorCodec.from_secret(secret))
    cache.add_tier(disk)
    m = cache.match(prompt, NS)
    cache.commit(m, lambda i: (torch.full(SHAPE, float(i)), torch.full(SHAPE, float(i)).nbytes))
    cache.release(m)
    flush_tiers(cache)
    return disk


def test_secret_is_created_0600_once_and_read_back(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    secret, created = persisted_secret(root)
    assert created and len(bytes.fromhex(secret)) == 32
    assert stat.S_IMODE((root / "salt-secret").stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert persisted_secret(root) == (secret, False)
    assert persisted_secret(tmp_path / "other")[0] != secret  # random, not derived from anything


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_secret_file_with_a_wider_mode_is_refused(tmp_path: Path, mode: int) -> None:
    secret, _ = persisted_secret(tmp_path)
    (tmp_path / "salt-secret").chmod(mode)
    with pytest.raises(SecretFileError, match=f"mode {mode:04o}.*chmod 600"):
        read_persisted_secret(tmp_path)


def test_secret_file_that_is_a_link_or_garbage_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("a" * 64)
    target.chmod(0o600)
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "salt-secret").symlink_to(target)
    with pytest.raises(SecretFileError, match="symbolic link"):
        persisted_secret(tmp_path / "tier")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "salt-secret").write_text("not a secret\n")
    (bad / "salt-secret").chmod(0o600)
    with pytest.raises(SecretFileError, match="64 hex digits"):
        persisted_secret(bad)


def test_an_explicit_secret_wins_and_creates_no_file(tmp_path: Path) -> None:
    assert disk_secret(tmp_path, "given-secret-of-the-deployment", None) == "given-secret-of-the-deployment"
    assert not (tmp_path / "salt-secret").exists()
    assert disk_secret(None, None, None) is None
    persisted = disk_secret(tmp_path, None, None)
    assert persisted == (tmp_path / "salt-secret").read_text().strip()


def test_namespaces_of_another_secret_are_listed_and_gc_removes_only_them(tmp_path: Path) -> None:
    current, _ = persisted_secret(tmp_path)
    # (other prompts each time: a tier skips a key it already holds, whichever namespace wrote it)
    fill(tmp_path, "an-earlier-random-secret-0123456789", [t + 1000 for t in PROMPT]).close()
    fill(tmp_path, "another-earlier-secret-0123456789ab", [t + 2000 for t in PROMPT]).close()
    mine = fill(tmp_path, current)
    mine_tag = mine.codec.namespace_tag(NS.root)
    mine.close()
    spaces = scan_namespaces(tmp_path, TensorCodec.from_secret(current))
    assert len(spaces) == 3 and all(n.entries == 5 for n in spaces)
    stale = stale_namespaces(tmp_path, TensorCodec.from_secret(current))
    assert sorted(n.tag for n in spaces if n not in stale) == [mine_tag]

    dry = CliRunner().invoke(app, ["cache", "gc", str(tmp_path), "--dry-run"])
    assert dry.exit_code == 0 and "would remove 2 unreadable namespace directories" in dry.output
    assert len(scan_namespaces(tmp_path, TensorCodec.from_secret(current))) == 3

    env = {"PREFIXCACHE_SALT_SECRET": ""}
    done = CliRunner().invoke(app, ["cache", "gc", str(tmp_path)], env=env)
    assert done.exit_code == 0, done.output
    assert "removed 2 unreadable namespace directories" in done.output
    assert [n.tag for n in scan_namespaces(tmp_path, TensorCodec.from_secret(current))] == [mine_tag]
    # What the current secret wrote is still served.
    again = DiskTier(tmp_path, codec=TensorCodec.from_secret(current))
    assert again.stats().entries == 5
    again.close()


def test_gc_without_a_secret_is_a_clean_error(tmp_path: Path) -> None:
    env = {**os.environ, "PREFIXCACHE_SALT_SECRET": "", "PYTHONPATH": SRC}
    cmd = [sys.executable, "-m", "prefixcache", "cache", "gc", str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.startswith("prefixcache cache gc: Invalid value for DIRECTORY: ")
        and "keeps no salt" in r.stderr
    )


# ---------------------------------------------------------------------------- a real restart
SRC = str(Path(prefixcache.__file__).resolve().parents[1])
SYSTEM = "You answer in one short sentence about the hotel. The sauna opens at four. " * 6


def start(tmp: Path, name: str, disk: Path, secret: str | None = None) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env |= {"PYTHONPATH": SRC + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    if secret is not None:
        env["PREFIXCACHE_SALT_SECRET"] = secret
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--port", str(port), "--threads", "1"]
    cmd += ["--disk-cache", str(disk)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout_s=300)
    except RuntimeError:
        stop_process_tree(proc)
        raise AssertionError(log.read_text()[-3000:]) from None
    return proc, url, log


def cached_tokens(url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=8,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When?"}],
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens_details.cached_tokens or 0


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.mark.model
def test_serve_with_a_disk_cache_and_no_secret_is_warm_after_a_restart(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    proc, url, _ = start(tmp_path, "first", disk)
    try:
        answer, cached = cached_tokens(url)
        assert cached == 0
    finally:
        stop(proc)
    assert stat.S_IMODE((disk / "salt-secret").stat().st_mode) == 0o600
    proc, url, log = start(tmp_path, "second", disk)
    try:
        again, cached = cached_tokens(url)
        assert cached > 0 and again == answer
    finally:
        stop(proc)
    assert "another salt secret" not in log.read_text()
    assert len(scan_namespaces(disk, TensorCodec.from_secret(read_persisted_secret(disk)))) == 1

    # A server given another secret on the same directory: cold, and told why and what to do.
    proc, url, log = start(tmp_path, "third", disk, secret="a-different-secret-given-by-env")
    try:
        assert cached_tokens(url)[1] == 0
    finally:
        stop(proc)
    text = log.read_text()
    assert "1 namespace directories" in text and f"prefixcache cache gc {disk}" in text
