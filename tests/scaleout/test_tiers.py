"""Disk and Redis tiers under a real PrefixCache, with tensor payloads (no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache.cache import Namespace, PrefixCache
from prefixcache.cache.tiers import CorruptEntry, DiskTier, RedisTier, TensorCodec, attach_tiers, flush_tiers

B = 4  # tokens per block
SHAPE = (2, 2, 1, B, 3)  # [layers, 2, kv_heads, B, head_dim]


def payload_for(tokens: list[int], i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic block payload derived from the prefix up to block i (like real KV)."""
    g = torch.Generator().manual_seed(hash(tuple(tokens[: (i + 1) * B])) & 0xFFFFFFFF)
    return torch.randn(SHAPE, generator=g).to(dtype)


def make_cache(capacity: int = 1 << 20) -> PrefixCache:
    return PrefixCache(block_size=B, capacity_bytes=capacity)


def run(cache: PrefixCache, tokens: list[int], ns: Namespace) -> tuple[int, list[torch.Tensor]]:
    """One request: match, commit, release. Returns (cached tokens, the hit payloads)."""
    m = cache.match(tokens, ns)
    try:
        hit = [b.payload.clone() for b in m.blocks]
        cache.commit(m, lambda i: (payload_for(tokens, i), payload_for(tokens, i).nbytes))
        return m.cached_tokens, hit
    finally:
        cache.release(m)


NS = Namespace.create("tiny|float32|B4|kv1", tenant="t", salt=b"s")
PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks, at most 20 cached


# ---------------------------------------------------------------------------- codec
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_roundtrip_is_bit_exact(dtype: torch.dtype) -> None:
    codec = TensorCodec()
    t = payload_for(PROMPT, 0, dtype)
    data = codec.encode(b"k" * 32, None, b"\x01\x00\x00\x00" * B, t)
    e = codec.decode(data, key=b"k" * 32, parent=None, tokens=b"\x01\x00\x00\x00" * B)
    assert e.payload.dtype == dtype and e.payload.shape == t.shape
    assert torch.equal(e.payload, t)
    assert e.nbytes == t.numel() * t.element_size()


def test_codec_rejects_any_flipped_byte_and_wrong_expectations() -> None:
    codec = TensorCodec()
    data = codec.encode(b"k" * 32, b"p" * 32, b"tttt" * B, payload_for(PROMPT, 1))
    for pos in (0, 10, 40, 80, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptEntry):
            codec.decode(bytes(bad))
    with pytest.raises(CorruptEntry):
        codec.decode(data[:-5])
    with pytest.raises(CorruptEntry, match="key"):
        codec.decode(data, key=b"x" * 32)
    with pytest.raises(CorruptEntry, match="parent"):
        codec.decode(data, parent=None)
    with pytest.raises(CorruptEntry, match="token"):
        codec.decode(data, tokens=b"uuuu" * B)


# ---------------------------------------------------------------------------- disk
def test_restarted_cache_is_warm_from_disk_and_bit_exact(tmp_path: Path) -> None:
    a = make_cache()
    attach_tiers(a, disk_dir=tmp_path)
    assert run(a, PROMPT, NS)[0] == 0
    flush_tiers(a)
    # "Restart": a fresh cache (empty memory) over the same directory.
    b = make_cache()
    (disk,) = attach_tiers(b, disk_dir=tmp_path)
    cached, payloads = run(b, PROMPT, NS)
    assert cached == 20
    assert all(torch.equal(p, payload_for(PROMPT, i)) for i, p in enumerate(payloads))
    assert disk.stats().hits == 5 and b.stats().tier_hits == 5
    b.check_integrity()


def test_corrupt_disk_entry_is_a_counted_miss_never_served_and_deleted(tmp_path: Path) -> None:
    a = make_cache()
    (disk_a,) = attach_tiers(a, disk_dir=tmp_path)
    run(a, PROMPT, NS)
    flush_tiers(a)
    keys = a.block_keys(PROMPT, NS)
    path = disk_a.path_of(keys[2])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped bit pattern in the tensor bytes
    path.write_bytes(bytes(raw))

    b = make_cache()
    (disk_b,) = attach_tiers(b, disk_dir=tmp_path)
    cached, payloads = run(b, PROMPT, NS)
    assert cached == 8  # blocks 0 and 1 from disk; block 2 is bad, so the run stops there
    assert all(torch.equal(p, payload_for(PROMPT, i)) for i, p in enumerate(payloads))
    assert disk_b.stats().corrupt == 1
    flush_tiers(b)  # the recomputed block 2 is written through again, verified
    c = make_cache()
    attach_tiers(c, disk_dir=tmp_path)
    assert run(c, PROMPT, NS)[0] == 20


def test_disk_swaps_in_entry_atomically_and_clears_interrupted_writes(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    leftover = tmp_path / ".tmp" / "deadbeef.1.1.tmp"
    leftover.write_bytes(b"half a write")
    disk.close()
    DiskTier(tmp_path).close()
    assert not leftover.exists()
    # A truncated entry (what a non-atomic writer could leave) is detected.
    a = make_cache()
    (d,) = attach_tiers(a, disk_dir=tmp_path)
    run(a, PROMPT, NS)
    flush_tiers(a)
    key0 = a.block_keys(PROMPT, NS)[0]
    d.path_of(key0).write_bytes(d.path_of(key0).read_bytes()[:50])
    b = make_cache()
    (db,) = attach_tiers(b, disk_dir=tmp_path)
    assert run(b, PROMPT, NS)[0] == 0
    assert db.stats().corrupt == 1


def test_disk_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    probe = TensorCodec().encode(b"k" * 32, b"p" * 32, b"tttt" * B, payload_for(PROMPT, 0))
    disk = DiskTier(tmp_path, capacity_bytes=3 * len(probe) + 10)
    cache = make_cache()
    cache.add_tier(disk)
    run(cache, PROMPT, NS)
    disk.flush()
    s = disk.stats()
    assert s.entries == 3 and s.evictions == 2 and s.bytes <= disk.capacity_bytes
    keys = cache.block_keys(PROMPT, NS)
    assert [k in disk for k in keys] == [False, False, True, True, True]


def test_spill_tier_takes_blocks_evicted_from_memory_and_promotes_them_back(tmp_path: Path) -> None:
    nbytes = payload_for(PROMPT, 0).nbytes
    cache = make_cache(capacity=6 * nbytes)
    (disk,) = attach_tiers(cache, disk_dir=tmp_path, disk_write_through=False)
    other = list(range(500, 521))
    run(cache, PROMPT, NS)
    run(cache, other, NS)  # needs room: PROMPT's blocks are evicted, then demoted to disk
    disk.flush()
    assert cache.stats().evictions["capacity"] >= 4 and disk.stats().writes >= 4
    cached, payloads = run(cache, PROMPT, NS)
    assert cached == 20 and disk.stats().hits >= 4
    assert all(torch.equal(p, payload_for(PROMPT, i)) for i, p in enumerate(payloads))
    cache.check_integrity()


# ---------------------------------------------------------------------------- redis
@pytest.mark.redis
def test_replica_b_hits_blocks_replica_a_wrote_to_redis(redis_url: str) -> None:
    a, b = make_cache(), make_cache()
    (ra,) = attach_tiers(a, redis_url=redis_url)
    (rb,) = attach_tiers(b, redis_url=redis_url)
    assert run(a, PROMPT, NS)[0] == 0
    ra.flush()
    cached, payloads = run(b, PROMPT, NS)
    assert cached == 20 and rb.stats().hits == 5
    assert all(torch.equal(p, payload_for(PROMPT, i)) for i, p in enumerate(payloads))
    # Another tenant (another salt) never sees them.
    other = Namespace.create("tiny|float32|B4|kv1", tenant="u", salt=b"other")
    assert run(b, PROMPT, other)[0] == 0
    # Entries expire through Redis: the TTL is set.
    import redis

    c = redis.Redis.from_url(redis_url)
    ttl = c.ttl(ra.redis_key(a.block_keys(PROMPT, NS)[0], NS.root))
    assert 0 < ttl <= 300


@pytest.mark.redis
def test_corrupt_redis_entry_is_a_counted_miss_never_served_and_deleted(redis_url: str) -> None:
    import redis

    a, b = make_cache(), make_cache()
    (ra,) = attach_tiers(a, redis_url=redis_url)
    (rb,) = attach_tiers(b, redis_url=redis_url)
    run(a, PROMPT, NS)
    ra.flush()
    keys = a.block_keys(PROMPT, NS)
    c = redis.Redis.from_url(redis_url)
    name = ra.redis_key(keys[1], NS.root)
    raw = bytearray(c.get(name))
    raw[-40] ^= 0x55
    c.set(name, bytes(raw))
    cached, payloads = run(b, PROMPT, NS)
    assert cached == 4 and torch.equal(payloads[0], payload_for(PROMPT, 0))
    assert rb.stats().corrupt == 1
    rb.flush()
    # Deleted, then rewritten by b's write-through of the recomputed block.
    got = c.get(name)
    assert got is not None and TensorCodec().decode(got, key=keys[1]) is not None
    # A value swapped in under another key's name (a misplaced entry) is refused too.
    c.set(ra.redis_key(keys[0], NS.root), c.get(ra.redis_key(keys[3], NS.root)))
    d = make_cache()
    (rd,) = attach_tiers(d, redis_url=redis_url)
    assert run(d, PROMPT, NS)[0] == 0 and rd.stats().corrupt == 1


@pytest.mark.redis
def test_redis_killed_mid_run_every_request_still_succeeds(own_redis) -> None:  # noqa: ANN001
    a = make_cache()
    (ra,) = attach_tiers(a, redis_url=own_redis.url)
    prompts = [[t, *range(200 + 7 * t, 220 + 7 * t)] for t in range(12)]
    for p in prompts[:4]:
        run(a, p, NS)
    ra.flush()
    own_redis.kill()
    served = 0
    for p in prompts:  # fresh caches: every lookup has to go down to the (dead) tier
        c = make_cache()
        (rc,) = attach_tiers(c, redis_url=own_redis.url)
        cached, _ = run(c, p, NS)
        assert cached == 0
        served += 1
        rc.flush()
        assert rc.stats().errors >= 1
    assert served == len(prompts)
    # One shared tier: after the first failure the breaker skips the backend.
    for p in prompts:
        run(a, list(reversed(p)), NS)
    s = ra.stats()
    assert s.errors >= 1 and s.skipped >= 1 and ra.breaker.is_open
    # Redis back: after the backoff, the tier serves again.
    own_redis.start()
    ra.breaker.open_until = 0.0
    c = make_cache()
    c.add_tier(ra)
    run(a, prompts[5], NS)
    ra.flush()
    assert run(c, prompts[5], NS)[0] == 20


@pytest.mark.redis
def test_slow_redis_times_out_into_a_counted_miss(redis_url: str) -> None:
    import redis

    a = make_cache()
    tier = RedisTier(redis_url, socket_timeout_s=0.1, connect_timeout_s=0.1)
    a.add_tier(tier)
    run(a, PROMPT, NS)
    tier.flush()
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("CLIENT", "PAUSE", "800", "ALL")  # every other client now stalls
    try:
        b = make_cache()
        b.add_tier(tier)
        assert run(b, PROMPT, NS)[0] == 0  # the read timed out: recomputed
        assert tier.stats().errors >= 1 and tier.breaker.is_open
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")


def test_background_writer_bounds_queued_bytes_and_never_blocks() -> None:
    import threading

    from prefixcache.cache.tiers import BackgroundWriter

    gate = threading.Event()
    ran: list[int] = []
    w = BackgroundWriter("t", maxsize=8, max_bytes=100)
    assert w.submit(gate.wait, 10)  # holds the thread
    assert w.submit(lambda: ran.append(1), 60)
    assert not w.submit(lambda: ran.append(2), 60)  # 130 > 100 bytes pending: dropped
    assert w.submit(lambda: ran.append(3), 30)
    gate.set()
    assert w.flush(5)
    assert ran == [1, 3]
    assert w.submit(lambda: ran.append(4), 500)  # nothing pending: one oversized job may go
    w.close()
    assert ran == [1, 3, 4] and not w.submit(lambda: None)


@pytest.mark.redis
def test_keep_warm_refresh_extends_pinned_blocks_in_redis_and_rewrites_lost_ones(redis_url: str) -> None:
    import redis

    from prefixcache.cache.tiers import refresh_pinned

    cache = make_cache()
    (rt,) = attach_tiers(cache, redis_url=redis_url, pin_refresh_s=None)
    run(cache, PROMPT, NS)
    rt.flush()
    assert cache.pin(PROMPT, NS) == 20
    keys = cache.block_keys(PROMPT, NS)
    c = redis.Redis.from_url(redis_url)
    c.delete(rt.redis_key(keys[3], NS.root))  # Redis dropped one (maxmemory, restart)
    assert refresh_pinned(cache, ttl_s=7200) == 4
    rt.flush()
    # Asked for 7200 s; the tier's maximum (1 hour by default) caps it.
    assert rt.max_ttl_s == 3600
    assert all(3500 < c.ttl(rt.redis_key(k, NS.root)) <= 3600 for k in keys[:3])
    assert c.exists(rt.redis_key(keys[3], NS.root)) == 1  # re-written from the pinned copy
    other = make_cache()
    attach_tiers(other, redis_url=redis_url, pin_refresh_s=None)
    assert run(other, PROMPT, NS)[0] == 20
