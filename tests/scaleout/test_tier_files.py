"""The disk tier's files: 0600 files in 0700 directories, names checked (hex digits only) before
any path is built, no symbolic link followed; a namespace's entries removed from disk and Redis
while every other namespace's stay; Redis entries' expiry capped; the Redis password never logged."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from prefixcache.cache import Namespace, PrefixCache
from prefixcache.cache.tiers import DiskTier, RedisTier, attach_tiers, flush_tiers, redacted_url

B = 4
SHAPE = (2, 2, 1, B, 3)
NS_A = Namespace.create("tiny|float32|B4|kv1", tenant="a", salt=b"salt-a")
NS_B = Namespace.create("tiny|float32|B4|kv1", tenant="b", salt=b"salt-b")
PROMPT = list(range(100, 121))  # 5 full blocks


def run(cache: PrefixCache, tokens: list[int], ns: Namespace) -> int:
    m = cache.match(tokens, ns)
    try:
        cache.commit(m, lambda i: (torch.full(SHAPE, float(i)), torch.full(SHAPE, float(i)).nbytes))
        return m.cached_tokens
    finally:
        cache.release(m)


def make_cache() -> PrefixCache:
    return PrefixCache(block_size=B, capacity_bytes=1 << 20)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


# ---------------------------------------------------------------------------- modes and names
def test_disk_tier_creates_files_0600_and_directories_0700(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    cache = make_cache()
    (disk,) = attach_tiers(cache, disk_dir=root)
    run(cache, PROMPT, NS_A)
    flush_tiers(cache)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    dirs = sorted(p for p in root.rglob("*") if p.is_dir())
    assert len(files) == 5
    assert {mode(p) for p in files} == {0o600}
    # root, .tmp, the namespace directory and its fan-out directories
    assert {mode(p) for p in [root, *dirs]} == {0o700}
    tag = disk.codec.namespace_tag(NS_A.root)
    assert {p.relative_to(root).parts[0] for p in files} == {tag}


@pytest.mark.parametrize(
    "name",
    [
        "../../../etc/passwd",
        "..",
        "/etc/shadow",
        "a" * 63,
        "A" * 64,  # upper case: not a name this tier writes
        "a" * 62 + "/x",
        "a" * 64 + "\x00",
        "g" * 64,
        "",
    ],
)
def test_an_entry_name_that_is_not_64_lowercase_hex_is_rejected_before_any_path(
    tmp_path: Path, name: str
) -> None:
    disk = DiskTier(tmp_path)
    tag = "0" * 32
    with pytest.raises(ValueError, match="invalid entry name"):
        disk.entry_path(tag, name)
    with pytest.raises(ValueError, match="invalid namespace tag"):
        disk.entry_path(name, "0" * 64)
    assert disk.entry_path(tag, "ab" * 32) == tmp_path / tag / "ab" / f"{'ab' * 32}.kv"
    disk.close()


def test_foreign_names_and_links_in_the_directory_are_never_indexed_or_followed(tmp_path: Path) -> None:
    cache = make_cache()
    (disk,) = attach_tiers(cache, disk_dir=tmp_path)
    run(cache, PROMPT, NS_A)
    flush_tiers(cache)
    keys = cache.block_keys(PROMPT, NS_A)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.kv"
    outside.write_bytes(b"not yours")
    tag = disk.codec.namespace_tag(NS_A.root)
    (tmp_path / tag / "zz").mkdir()  # not a fan-out name
    (tmp_path / tag / "zz" / f"{'0' * 64}.kv").write_bytes(b"x")
    (tmp_path / tag / "00" / "..evil.kv").parent.mkdir(exist_ok=True)
    (tmp_path / tag / "00" / "..evil.kv").write_bytes(b"x")
    (tmp_path / "NOT-A-TAG").mkdir()
    # Block 2's entry replaced by a link to a file outside the tier.
    link = disk.path_of(keys[2])
    link.unlink()
    link.symlink_to(outside)
    fresh = make_cache()
    (disk2,) = attach_tiers(fresh, disk_dir=tmp_path)
    assert disk2.stats().entries == 4  # the four genuine entries; the link and odd names ignored
    assert run(fresh, PROMPT, NS_A) == 8  # blocks 0, 1; the link is refused as corrupt and removed
    assert disk2.stats().corrupt == 1
    assert not link.is_symlink() and outside.read_bytes() == b"not yours"


# ---------------------------------------------------------------------------- remove a namespace
def test_disk_remove_namespace_deletes_that_tenant_only(tmp_path: Path) -> None:
    cache = make_cache()
    (disk,) = attach_tiers(cache, disk_dir=tmp_path)
    run(cache, PROMPT, NS_A)
    run(cache, PROMPT, NS_B)
    flush_tiers(cache)
    assert disk.stats().entries == 10
    assert cache.remove_tier_entries(NS_A) == {"disk": 5}
    assert disk.stats().entries == 5
    assert not (tmp_path / disk.codec.namespace_tag(NS_A.root)).exists()
    assert cache.remove_tier_entries(NS_A) == {"disk": 0}
    fresh = make_cache()
    attach_tiers(fresh, disk_dir=tmp_path)
    assert run(fresh, PROMPT, NS_A) == 0
    assert run(fresh, PROMPT, NS_B) == 20


@pytest.mark.redis
def test_redis_remove_namespace_deletes_that_tenant_only(redis_url: str) -> None:
    import redis

    cache = make_cache()
    (rt,) = attach_tiers(cache, redis_url=redis_url, pin_refresh_s=None)
    run(cache, PROMPT, NS_A)
    run(cache, PROMPT, NS_B)
    rt.flush()
    client = redis.Redis.from_url(redis_url)
    assert len(list(client.scan_iter(match="prefixcache:*"))) == 10
    assert cache.remove_tier_entries(NS_A) == {"redis": 5}
    left = sorted(client.scan_iter(match="prefixcache:*"))
    assert left == sorted(rt.redis_key(k, NS_B.root).encode() for k in cache.block_keys(PROMPT, NS_B))
    fresh = make_cache()
    attach_tiers(fresh, redis_url=redis_url, pin_refresh_s=None)
    assert run(fresh, PROMPT, NS_A) == 0
    assert run(fresh, PROMPT, NS_B) == 20
    flush_tiers(fresh)  # no write of this test lands in the next one's Redis


# ---------------------------------------------------------------------------- Redis bounds
@pytest.mark.redis
def test_redis_expiry_is_capped_whatever_ttl_is_asked(redis_url: str) -> None:
    import redis

    cache = make_cache()
    (rt,) = attach_tiers(cache, redis_url=redis_url, redis_max_ttl_s=120, pin_refresh_s=None)
    prompt = list(range(300, 321))  # blocks of this test alone
    m = cache.match(prompt, NS_A, ttl_s=86400.0)  # a client asking for a day
    cache.commit(m, lambda i: (torch.zeros(SHAPE), torch.zeros(SHAPE).nbytes))
    cache.release(m)
    rt.flush()
    client = redis.Redis.from_url(redis_url)
    ttls = [client.ttl(rt.redis_key(k, NS_A.root)) for k in cache.block_keys(prompt, NS_A)]
    assert all(100 < t <= 120 for t in ttls), ttls
    assert rt.capped_ttl(86400.0) == 120 and rt.capped_ttl(0.2) == 1 and rt.capped_ttl(60.5) == 61
    with pytest.raises(ValueError, match="max_ttl_s"):
        RedisTier(redis_url, max_ttl_s=0)


def test_redis_password_never_reaches_the_tier_logs(caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on: every call fails and is logged
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://app:hunter2-secret@127.0.0.1:{port}/0"
    caplog.set_level(logging.DEBUG)
    cache = make_cache()
    (rt,) = attach_tiers(cache, redis_url=url, pin_refresh_s=None)
    assert run(cache, PROMPT, NS_A) == 0
    rt.flush()
    assert rt.stats().errors >= 1
    assert "hunter2" not in caplog.text and "hunter2" not in repr(rt.url)
    assert f"redis://app:***@127.0.0.1:{port}/0" in caplog.text
    assert redacted_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted_url("rediss://:pw@[::1]:6380/2") == "rediss://:***@[::1]:6380/2"
