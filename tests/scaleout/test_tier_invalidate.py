"""PrefixCache.invalidate and the tiers' remove_keys: what the exactness audit removes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tests.scaleout.test_tiers import NS, PROMPT, make_cache, run

from prefixcache.cache.tiers import DiskTier, RedisTier

OTHER = [*PROMPT[:8], 7, 7, 7, 7, 7, 7, 7, 7, 7]  # shares blocks 0-1 with PROMPT, then branches


def test_invalidate_removes_the_blocks_and_everything_cached_after_them() -> None:
    cache = make_cache()
    run(cache, PROMPT, NS)
    run(cache, OTHER, NS)
    keys, other = cache.block_keys(PROMPT, NS), cache.block_keys(OTHER, NS)
    removed, left = cache.invalidate(NS, keys[3:4])
    assert left == 0 and removed >= 2  # block 3 and its child 4 (with their run)
    assert cache.snapshots(keys[3:], missing_ok=True) == []
    assert len(cache.snapshots(other, missing_ok=True)) == len(other)  # the branch is untouched
    removed, left = cache.invalidate(NS, keys[1:2])  # the shared block: both chains after it go
    assert left == 0 and cache.snapshots(other[1:], missing_ok=True) == []
    cache.check_integrity()


def test_invalidate_keeps_blocks_a_request_reads_until_it_ends() -> None:
    cache = make_cache()
    run(cache, PROMPT, NS)
    keys = cache.block_keys(PROMPT, NS)
    m = cache.match(PROMPT, NS)
    try:
        assert cache.invalidate(NS, keys[:1])[1] == 1
    finally:
        cache.release(m)
    assert cache.invalidate(NS, keys[:1])[1] == 0
    cache.check_integrity()


def _tier_round(tier: object, gone: Callable[[bytes], bool]) -> None:
    cache = make_cache()
    cache.add_tier(tier)  # type: ignore[arg-type]
    run(cache, PROMPT, NS)
    tier.flush()  # type: ignore[attr-defined]
    keys = cache.block_keys(PROMPT, NS)
    assert cache.remove_tier_keys(NS, keys[2:]) == {tier.name: 3}  # type: ignore[attr-defined]
    assert [gone(bytes(k)) for k in keys] == [False, False, True, True, True]
    fresh = make_cache()
    fresh.add_tier(tier)  # type: ignore[arg-type]
    assert run(fresh, PROMPT, NS)[0] == 8  # a fresh cache promotes blocks 0-1 only


def test_disk_tier_remove_keys(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    _tier_round(disk, lambda key: not disk.path_of(key, NS.root).exists())


@pytest.mark.redis
def test_redis_tier_remove_keys(redis_url: str) -> None:
    tier = RedisTier(redis_url, sync_writes=True)
    _tier_round(tier, lambda key: not tier.client.exists(tier.redis_key(key, NS.root)))
