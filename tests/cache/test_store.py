"""BlockStore: exact eviction order, TTL expiry and refresh, pins, references, collisions."""

from __future__ import annotations

import hashlib

import pytest

from prefixcache.cache import FakeClock, PinBudgetExceeded, PrefixCache

B = 4  # tokens per block in these tests
NB = 100  # bytes per block


def payload(i: int) -> tuple[str, int]:
    return (f"kv{i}", NB)


def make(
    capacity_blocks: int = 100, pinned_blocks: int = 10, ttl: float = 300.0
) -> tuple[PrefixCache, FakeClock]:
    clock = FakeClock()
    cache = PrefixCache(
        block_size=B,
        capacity_bytes=capacity_blocks * NB,
        pinned_capacity_bytes=pinned_blocks * NB,
        default_ttl_s=ttl,
        clock=clock,
    )
    return cache, clock


def run(cache: PrefixCache, tokens: list[int], tenant_salt: bytes = b"", **kw: object):
    """One request: match, commit, release. Returns the match."""
    ns = cache.namespace("m", salt=tenant_salt)
    m = cache.match(tokens, ns, **kw)  # type: ignore[arg-type]
    cache.commit(m, payload)
    cache.release(m)
    cache.check_integrity()
    return m


def prompt(prefix: int, n_blocks: int, tail: int = 1) -> list[int]:
    """n_blocks full blocks whose content is determined by ``prefix``, then a partial tail."""
    return [prefix * 1000 + i for i in range(n_blocks * B)] + [7] * tail


def test_miss_then_hit_reports_exact_blocks() -> None:
    cache, _ = make()
    t = prompt(1, 3)
    m1 = run(cache, t)
    assert (m1.cached_tokens, len(m1.written), m1.outcome.value) == (0, 3, "miss")
    assert m1.usage.cache_write_tokens == 12
    m2 = run(cache, t)
    assert m2.cached_tokens == 12 and m2.usage.cache_write_tokens == 0 and m2.outcome.value == "hit"
    assert [b.key for b in m2.blocks] == m1.keys
    # Diverge inside block 2: blocks 0 and 1 hit, block 2 is new.
    t3 = t[:9] + [99] + t[10:]
    m3 = run(cache, t3)
    assert m3.cached_tokens == 8 and len(m3.written) == 1 and m3.outcome.value == "partial"
    s = cache.stats()
    assert (s.queried_tokens, s.hit_tokens, s.written_tokens, s.blocks) == (39, 20, 16, 4)


def test_match_leaves_one_token_to_compute_and_honours_alignment() -> None:
    cache, _ = make()
    exact = prompt(1, 4, tail=0)  # 16 tokens, exactly 4 blocks
    run(cache, exact)
    m = run(cache, exact)
    assert m.cached_tokens == 12  # the last block is recomputed so there are logits to sample
    m = run(cache, exact + [5], align_tokens=8)
    assert m.cached_tokens == 16
    m = run(cache, exact[:12] + [5], align_tokens=8)
    assert m.cached_tokens == 8  # 3 cached blocks round down to the 8-token boundary
    short = [1, 2, 3]
    m = run(cache, short)
    assert m.cached_tokens == 0 and m.keys == []


def test_capacity_eviction_is_lru_and_trims_chains_from_the_tail() -> None:
    cache, clock = make(capacity_blocks=5)
    a = run(cache, prompt(1, 3))  # blocks a0 a1 a2
    clock.advance(1)
    b = run(cache, prompt(2, 2))  # blocks b0 b1: cache full (5)
    clock.advance(1)
    run(cache, prompt(1, 3))  # touch chain a: now b is least recently used
    clock.advance(1)
    evicted: list[bytes] = []
    cache.store.add_listener(lambda ev, blk: evicted.append(blk.key) if ev == "evict" else None)
    c = run(cache, prompt(3, 2))
    # b1 (the tail) goes before b0; chain a is untouched.
    assert evicted == [b.keys[1], b.keys[0]]
    assert all(k in cache.store for k in a.keys + c.keys)
    clock.advance(1)
    evicted.clear()
    run(cache, prompt(4, 1))
    assert evicted == [a.keys[2]]  # a is now older than c: its tail goes first
    assert cache.stats().evictions["capacity"] == 3


def test_blocks_in_use_survive_pressure() -> None:
    cache, _ = make(capacity_blocks=3)
    ns = cache.namespace("m")
    held = cache.match(prompt(1, 2), ns)
    cache.commit(held, payload)  # 2 blocks, still referenced
    m = cache.match(prompt(2, 3), ns)
    r = cache.commit(m, payload)
    assert (r.written_blocks, r.skipped_blocks) == (1, 2)  # only one free slot; held blocks stay
    assert all(k in cache.store for k in held.keys)
    cache.release(m)
    cache.release(held)
    cache.check_integrity()
    assert cache.store.bytes <= cache.store.capacity_bytes


def test_ttl_expiry_and_refresh_on_hit() -> None:
    cache, clock = make(ttl=300)
    t = prompt(1, 2)
    run(cache, t)
    clock.advance(299)
    assert run(cache, t).cached_tokens == 8  # the hit refreshes the TTL
    clock.advance(299)
    assert run(cache, t).cached_tokens == 8
    clock.advance(300)  # exactly the TTL since the last use: due
    m = run(cache, t)
    assert m.cached_tokens == 0 and len(m.written) == 2
    assert cache.stats().expirations == 2


def test_longer_ttl_class_is_kept_and_only_covers_blocks_up_to_the_breakpoint() -> None:
    cache, clock = make(ttl=300)
    t = prompt(1, 3)
    first = run(cache, t, ttl_plan=[(8, 3600.0)])  # blocks 0-1 get 1h, block 2 keeps 5m
    assert [cache.store.get(k).ttl_s for k in first.keys] == [3600.0, 3600.0, 300.0]
    run(cache, t)  # a later default-TTL request does not shorten the class
    assert cache.store.get(first.keys[0]).ttl_s == 3600.0
    clock.advance(600)
    m = run(cache, t)
    assert m.cached_tokens == 8 and len(m.written) == 1  # block 2 expired, blocks 0-1 live


def test_pins_survive_pressure_and_expiry_within_their_own_budget() -> None:
    cache, clock = make(capacity_blocks=2, pinned_blocks=2, ttl=10)
    ns = cache.namespace("m")
    t = prompt(1, 2)
    run(cache, t)
    assert cache.pin(t, ns) == 8
    assert cache.store.bytes == 0 and cache.store.pinned_bytes == 2 * NB
    for i in range(2, 6):
        run(cache, prompt(i, 2))  # fills and churns the unpinned budget
    clock.advance(10_000)
    cache.sweep()
    assert run(cache, t).cached_tokens == 8
    with pytest.raises(PinBudgetExceeded):
        run(cache, prompt(9, 1))
        cache.pin(prompt(9, 1), ns)
    cache.check_integrity()
    assert cache.unpin(t, ns) == 8
    assert cache.store.pinned_bytes == 0
    cache.check_integrity()


def test_another_tenant_salt_never_hits() -> None:
    cache, _ = make()
    t = prompt(1, 3)
    run(cache, t, tenant_salt=b"tenant-a")
    assert run(cache, t, tenant_salt=b"tenant-b").cached_tokens == 0
    assert run(cache, t, tenant_salt=b"tenant-a").cached_tokens == 12


def test_forced_hash_collision_never_serves_the_wrong_block() -> None:
    clock = FakeClock()
    # A hasher that ignores the tokens: every prompt's k-th block gets the same key.
    cache = PrefixCache(block_size=B, clock=clock, hasher=lambda prev, block: hashlib.sha256(prev).digest())
    ns = cache.namespace("m")
    a = prompt(1, 2)
    b = prompt(2, 2)
    assert cache.block_keys(a, ns) == cache.block_keys(b, ns)  # the collision is real
    run(cache, a)
    m = run(cache, b)
    assert m.cached_tokens == 0 and len(m.written) == 0  # nothing wrong served, nothing clobbered
    assert cache.stats().collisions >= 1
    assert run(cache, a).cached_tokens == 8  # the original owner still hits


def test_flush_removes_only_that_tenants_unreferenced_blocks() -> None:
    cache, _ = make()
    ns_a = cache.namespace("m", tenant="a", salt=b"a")
    ns_b = cache.namespace("m", tenant="b", salt=b"b")
    for ns in (ns_a, ns_b):
        m = cache.match(prompt(1, 2), ns)
        cache.commit(m, payload)
        cache.release(m)
    assert cache.flush(ns_a) == 2
    assert cache.stats(tenant="a").blocks == 0 and cache.stats(tenant="b").blocks == 2
    cache.check_integrity()


def test_release_is_idempotent_and_commit_after_release_is_refused() -> None:
    cache, _ = make()
    m = cache.match(prompt(1, 1), cache.namespace("m"))
    cache.release(m)
    cache.release(m)
    with pytest.raises(RuntimeError, match="after release"):
        cache.commit(m, payload)


def test_commit_upto_tokens_stores_only_the_blocks_before_it() -> None:
    cache, _ = make()
    ns = cache.namespace("m")
    t = prompt(1, 4)
    m = cache.match(t, ns)
    r = cache.commit(m, payload, upto_tokens=9)  # blocks ending at 4 and 8; block 3 ends at 12
    cache.release(m)
    assert (r.written_blocks, r.written_tokens) == (2, 8)
    assert [k in cache.store for k in m.keys] == [True, True, False, False]


def test_a_hit_refreshes_the_whole_prefix_even_after_its_tail_is_evicted() -> None:
    # Only the deepest block of a hit is touched; its ancestors inherit that freshness when it
    # goes. Here block a1 is evicted at t=400 and a0 must still carry the hit at t=250.
    cache, clock = make(capacity_blocks=3, ttl=300)
    a = prompt(1, 2)
    run(cache, a)  # t=0: a0, a1
    clock.advance(250)
    assert run(cache, a).cached_tokens == 8  # t=250: hit through a1
    clock.advance(150)
    run(cache, prompt(2, 2))  # t=400: b0, b1 need room: a1 (least recent leaf) is evicted
    assert cache.store.get(cache.block_keys(a, cache.namespace("m"))[1]) is None
    clock.advance(100)  # t=500: a0 would have expired at 300 without the inherited hit
    m = run(cache, a)
    assert m.cached_tokens == 4 and len(m.written) == 1


def test_expired_chain_goes_tail_first_and_whole() -> None:
    cache, clock = make(ttl=300)
    a = prompt(1, 3)
    run(cache, a)
    evicted: list[bytes] = []
    cache.store.add_listener(lambda ev, blk: evicted.append(blk.key) if ev == "evict" else None)
    clock.advance(300)
    assert cache.sweep() == 3
    keys = cache.block_keys(a, cache.namespace("m"))
    assert evicted == keys[::-1]


def test_a_prefix_touched_below_its_child_expires_ttl_after_that_touch() -> None:
    # P is touched at t=100 while its child C (t=10) is cached; when C expires (t=310) P becomes
    # a leaf due at 400, behind Q (due at 500) in the expiry queue. The sweep must still remove P
    # at its time: at t=450 nothing of P may be served (it was once served up to t=700, the time
    # Q's expiry let the sweep reach it).
    cache, clock = make(ttl=300)
    p = prompt(1, 2)[: 2 * B]
    run(cache, p + [1])  # t=0: P
    clock.set(10)
    run(cache, p + prompt(2, 1))  # C, P's child
    clock.set(50)
    run(cache, prompt(3, 1))  # S: due at 350
    clock.set(100)
    assert run(cache, p + [2]).cached_tokens == 8  # P touched below C
    clock.set(200)
    run(cache, prompt(4, 1))  # Q: due at 500
    clock.set(320)
    run(cache, prompt(5, 1))  # C expired at 310: P is a leaf, due at 400
    clock.set(450)
    assert run(cache, p + [3]).cached_tokens == 0
    clock.set(460)
    assert run(cache, prompt(4, 1)).cached_tokens == 4  # Q is still there
