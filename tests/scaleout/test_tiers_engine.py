"""Tiers under real Engines: hits from disk and Redis give the logits and greedy text of cache-off."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixcache.cache import PrefixCache
from prefixcache.cache.tiers import attach_tiers, flush_tiers
from prefixcache.engine.engine import Engine

CHUNK = 16


def engine_with(runner: Any, *, chunk: int = CHUNK, **tiers: Any) -> tuple[Engine, list[Any]]:
    cache = PrefixCache(block_size=16)
    added = attach_tiers(cache, pin_refresh_s=None, **tiers)
    return Engine(runner, prefill_chunk=chunk, cache=cache), added


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def assert_exact(on: Engine, off: Engine, ids: list[int], max_tokens: int = 6) -> Any:
    a = on.generate(prompt_token_ids=ids, max_tokens=max_tokens, return_logits=True)
    b = off.generate(prompt_token_ids=ids, max_tokens=max_tokens, return_logits=True)
    assert torch.equal(a.first_logits, b.first_logits), a.usage
    assert a.tokens == b.tokens and a.text == b.text
    return a


@pytest.fixture
def off_engine(tiny_runner: Any) -> Any:
    e = Engine(tiny_runner, prefill_chunk=CHUNK, enable_cache=False)
    yield e
    e.close()


@pytest.mark.redis
def test_replica_b_hits_what_replica_a_computed_through_redis_exactly(
    tiny_runner, off_engine, redis_url
) -> None:  # noqa: ANN001
    a, (ra,) = engine_with(tiny_runner, redis_url=redis_url)
    b, (rb,) = engine_with(tiny_runner, redis_url=redis_url)
    try:
        ids = prompt(1)
        first = assert_exact(a, off_engine, ids)
        assert first.usage.cached_tokens == 0 and first.usage.cache_write_tokens == 96
        ra.flush()
        hit = assert_exact(b, off_engine, ids)  # B never saw this prompt: its memory is empty
        assert hit.usage.cached_tokens == 96 and hit.outcome == "hit"
        assert rb.stats().hits == 6 and b.stats().tier_hits == 6
        # A longer prompt over the same prefix continues from the promoted blocks, still exact.
        longer = assert_exact(b, off_engine, ids + prompt(2, 40))
        assert longer.usage.cached_tokens == 96
        b.cache.check_integrity()
    finally:
        a.close()
        b.close()


def test_restarted_engine_is_warm_from_its_disk_tier_exactly(tiny_runner, off_engine, tmp_path: Path) -> None:  # noqa: ANN001
    a, _ = engine_with(tiny_runner, disk_dir=tmp_path)
    ids = prompt(3, 130)
    assert_exact(a, off_engine, ids)
    flush_tiers(a.cache)
    a.close()
    b, (disk,) = engine_with(tiny_runner, disk_dir=tmp_path)  # a new process, in effect
    try:
        r = assert_exact(b, off_engine, ids)
        assert r.usage.cached_tokens == 128 and disk.stats().hits == 8
    finally:
        b.close()


@pytest.mark.redis
def test_corrupt_entries_in_each_tier_are_not_served(
    tiny_runner, off_engine, redis_url, tmp_path: Path
) -> None:  # noqa: ANN001
    import redis

    a, (da, ra) = engine_with(tiny_runner, disk_dir=tmp_path / "a", redis_url=redis_url)
    ids = prompt(4)
    assert_exact(a, off_engine, ids)
    flush_tiers(a.cache)
    ns = a.cache.namespace(a.fingerprint)
    keys = a.cache.block_keys(ids, ns)
    a.close()
    # Disk: block 1 damaged -> block 0 from disk; the rest continues from Redis (verified there).
    path = da.path_of(keys[1])
    raw = bytearray(path.read_bytes())
    raw[200] ^= 0x10
    path.write_bytes(bytes(raw))
    # Redis: block 4 damaged -> the run stops at 4; blocks 4 and 5 are recomputed.
    c = redis.Redis.from_url(redis_url)
    val = bytearray(c.get(ra.redis_key(keys[4], ns.root)))
    val[300] ^= 0x01
    c.set(ra.redis_key(keys[4], ns.root), bytes(val))
    b, (db, rb) = engine_with(tiny_runner, disk_dir=tmp_path / "a", redis_url=redis_url)
    try:
        r = assert_exact(b, off_engine, ids)
        assert r.usage.cached_tokens == 64  # blocks 0 (disk), 1-3 (Redis)
        assert db.stats().corrupt == 1 and db.stats().hits == 1
        assert rb.stats().corrupt == 1 and rb.stats().hits == 3
    finally:
        b.close()


@pytest.mark.redis
def test_redis_killed_mid_run_every_request_succeeds_exactly(tiny_runner, off_engine, own_redis) -> None:  # noqa: ANN001
    a, (ra,) = engine_with(tiny_runner, redis_url=own_redis.url)
    b, (rb,) = engine_with(tiny_runner, redis_url=own_redis.url)
    try:
        prompts = [prompt(10 + i, 70) for i in range(8)]
        for ids in prompts[:4]:
            assert_exact(a, off_engine, ids)
        ra.flush()
        assert assert_exact(b, off_engine, prompts[0]).usage.cached_tokens == 64
        own_redis.kill()
        for ids in prompts[1:]:  # B's memory lacks these; Redis is gone: recompute, exactly
            r = assert_exact(b, off_engine, ids)
            assert r.usage.cached_tokens == 0
        assert rb.stats().errors >= 1 and rb.stats().skipped >= 1
        assert assert_exact(b, off_engine, prompts[0]).usage.cached_tokens == 64  # memory still serves
    finally:
        a.close()
        b.close()


@pytest.mark.model
@pytest.mark.redis
def test_real_model_blocks_from_redis_and_disk_are_exact(real_runner, redis_url, tmp_path: Path) -> None:  # noqa: ANN001
    chunk = 64
    off = Engine(real_runner, prefill_chunk=chunk, enable_cache=False)
    a, (da, ra) = engine_with(real_runner, chunk=chunk, disk_dir=tmp_path, redis_url=redis_url)
    b, (rb,) = engine_with(real_runner, chunk=chunk, redis_url=redis_url)
    try:
        system = "You are a meticulous assistant for a logistics company. " * 20
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Where is parcel 42?"}]
        ids = a.render_ids(msgs)
        assert len(ids) > 2 * chunk
        assert_exact(a, off, ids)
        flush_tiers(a.cache)
        a.close()
        r = assert_exact(b, off, ids)  # from Redis
        assert (
            r.usage.cached_tokens == (len(ids) - 1) // b.alignment * b.alignment > 0 and rb.stats().hits > 0
        )
        c, (dc,) = engine_with(real_runner, chunk=chunk, disk_dir=tmp_path)  # a restart, from disk
        try:
            r = assert_exact(c, off, ids)
            assert r.usage.cached_tokens > 0 and dc.stats().hits > 0
        finally:
            c.close()
    finally:
        a.close()
        b.close()
        off.close()


@pytest.mark.redis
def test_sync_writes_give_read_your_writes_across_replicas(tiny_runner, off_engine, redis_url) -> None:  # noqa: ANN001
    a, _ = engine_with(tiny_runner, redis_url=redis_url, redis_sync_writes=True)
    b, _ = engine_with(tiny_runner, redis_url=redis_url, redis_sync_writes=True)
    try:
        for seed in range(20, 26):  # back to back, no flush: B sees what A just committed
            ids = prompt(seed, 60)
            a.generate(prompt_token_ids=ids, max_tokens=1)
            assert assert_exact(b, off_engine, ids, max_tokens=2).usage.cached_tokens == 48
    finally:
        a.close()
        b.close()
