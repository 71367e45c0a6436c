"""Tenants cannot slow or evict each other through the cache (issue 21, item 6).

* A tier read (a slow Redis) happens outside the cache's lock: :meth:`PrefixCache.prefetch`
  reads on the caller's thread, so another tenant's ``match`` runs while it waits; what it
  brings up is verified by the tier and then read as a hit.
* A flush removes its runs in slices: the lock is released between slices (another tenant's
  match runs in between).
* With a tenant capacity share, a tenant over it evicts its own leaves, not the others'.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from prefixcache.cache import FakeClock, PrefixCache, isolation
from prefixcache.cache.keys import pack_tokens, unpack_tokens
from prefixcache.cache.tiers.base import TierStats

B = 4
NB = 100  # bytes of every block


def make(capacity_blocks: int = 1000, **kw: Any) -> PrefixCache:
    return PrefixCache(
        block_size=B, capacity_bytes=capacity_blocks * NB, pinned_capacity_bytes=0, clock=FakeClock(), **kw
    )


def ns(cache: PrefixCache, tenant: str) -> Any:
    """The tenant's namespace: its own salt, as the server gives each API key's tenant."""
    return cache.namespace("m", tenant=tenant, salt=tenant)


def put(cache: PrefixCache, tokens: list[int], tenant: str) -> None:
    m = cache.match(tokens, ns(cache, tenant))
    cache.commit(m, lambda i: (f"{tenant}{i}", NB))
    cache.release(m)


class GatedTier:
    """A tier holding entries by key, whose reads wait until ``gate`` opens (a Redis answering
    slowly). Verifies as a real tier does: an entry is served only when its tokens match."""

    name = "gated"
    write_through = True

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[bytes, Any]] = {}
        self.gate = threading.Event()
        self.reading = threading.Event()

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[bytes], namespace: bytes, layout: Any = None
    ) -> list[tuple[Any, int]]:
        self.reading.set()
        assert self.gate.wait(30)
        out = []
        for key, toks in zip(keys, tokens, strict=True):
            entry = self.entries.get(bytes(key))
            if entry is None or entry[0] != toks:
                break
            out.append((entry[1], NB))
        return out

    def put(self, block: Any) -> None:
        self.entries[bytes(block.key)] = (bytes(block.tokens), block.payload)

    def stats(self) -> TierStats:
        return TierStats(self.name)

    def remove_namespace(self, namespace: bytes) -> int:
        return 0


def test_a_slow_tier_read_blocks_no_other_tenants_match() -> None:
    cache = make()
    cache.promote_in_match = False  # as an engine runs it: tiers are read by prefetch only
    tier = GatedTier()
    cache.add_tier(tier)
    a_tokens = list(range(1, 4 * B + 2))  # 4 full blocks and a token to compute
    put(cache, a_tokens, "a")
    a_ns = ns(cache, "a")
    assert cache.flush(a_ns) == 4  # memory forgets A's prompt; the tier keeps its 4 blocks
    b_tokens = [100 + t for t in range(2 * B + 1)]
    put(cache, b_tokens, "b")
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.append(cache.prefetch(a_tokens, a_ns)))
    reader.start()
    assert tier.reading.wait(10)  # A's prefetch waits inside the tier read
    m = cache.match(b_tokens, ns(cache, "b"))  # B's match while A waits
    assert m.cached_blocks == 2
    cache.release(m)
    assert reader.is_alive() and got == []  # A is still in the tier: B did not wait for it
    tier.gate.set()
    reader.join(10)
    assert got == [4]  # the 4 blocks came up, verified by the tier
    m = cache.match(a_tokens, a_ns)
    assert m.cached_blocks == 4 and [b.payload for b in m.blocks] == ["a0", "a1", "a2", "a3"]
    cache.release(m)
    cache.check_integrity()


def test_prefetch_inserts_only_what_the_tier_verifies_and_match_alone_reads_no_tier() -> None:
    cache = make()
    cache.promote_in_match = False
    tier = GatedTier()
    tier.gate.set()
    cache.add_tier(tier)
    tokens = list(range(1, 3 * B + 2))
    put(cache, tokens, "a")
    a_ns = ns(cache, "a")
    cache.flush(a_ns)
    # A wrong entry for block 1 (other tokens under its key): the tier serves block 0 only.
    key1 = cache.block_keys(tokens, a_ns)[1]
    tier.entries[bytes(key1)] = (pack_tokens([9] * B), "forged")
    tier.reading.clear()
    m = cache.match(tokens, a_ns)  # no promotion under the lock
    assert m.cached_blocks == 0 and not tier.reading.is_set()
    cache.release(m)
    assert cache.prefetch(tokens, a_ns) == 1
    m = cache.match(tokens, a_ns)
    assert m.cached_blocks == 1 and [b.payload for b in m.blocks] == ["a0"]
    cache.release(m)


def test_a_direct_cache_user_still_promotes_inside_match() -> None:
    cache = make()  # promote_in_match defaults to True: the behaviour before prefetch
    tier = GatedTier()
    tier.gate.set()
    cache.add_tier(tier)
    tokens = list(range(1, 2 * B + 2))
    put(cache, tokens, "a")
    a_ns = ns(cache, "a")
    cache.flush(a_ns)
    m = cache.match(tokens, a_ns)
    assert m.cached_blocks == 2 and [b.payload for b in m.blocks] == ["a0", "a1"]
    cache.release(m)


class CountingLock:
    """The cache's lock, counting acquisitions; ``between`` runs at each acquisition by the
    flushing thread after the first (so it runs while the flush has released the lock)."""

    def __init__(self, inner: Any, between: Any) -> None:
        self.inner = inner
        self.between = between
        self.acquisitions = 0
        self.flusher = threading.get_ident()

    def __enter__(self) -> Any:
        if threading.get_ident() == self.flusher:
            self.acquisitions += 1
            if self.acquisitions > 1:
                self.between()
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


def test_a_flush_releases_the_lock_between_slices_of_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "SLICE_RUNS", 10)
    cache = make()
    # 25 runs of tenant A (prompts that differ from their first block on) and one of B.
    for p in range(25):
        put(cache, [1000 + p] + list(range(1, 2 * B)), "a")
    b_tokens = [5] * (2 * B + 1)
    put(cache, b_tokens, "b")
    b_ns = ns(cache, "b")
    seen: list[tuple[int, int]] = []

    def other_tenant() -> None:  # B's match, between two slices: the flush does not hold the lock
        held = threading.Thread(target=lambda: seen.append((len(cache.store), _b_hit(cache, b_tokens, b_ns))))
        held.start()
        held.join(5)
        assert not held.is_alive()

    lock = CountingLock(cache.lock, other_tenant)
    monkeypatch.setattr(cache, "lock", lock)
    assert cache.flush(ns(cache, "a")) == 50
    # One hold to list the runs, three slices (10, 10, 5 runs: 20, 20, 10 blocks), then a second
    # pass's listing, which finds none of A's runs left: 5 holds; B matched between each two.
    assert lock.acquisitions == 5
    assert seen == [(52, 2), (32, 2), (12, 2), (2, 2)]
    assert len(cache.store) == 2  # B's two blocks
    monkeypatch.undo()
    cache.check_integrity()


def _b_hit(cache: PrefixCache, tokens: list[int], b_ns: Any) -> int:
    m = cache.match(tokens, b_ns)
    cache.release(m)
    return m.cached_blocks


def test_over_its_share_a_tenant_evicts_its_own_leaves_not_the_others() -> None:
    cache = make(capacity_blocks=10)
    cache.store.set_tenant_share(0.5)
    b_prompts = [[200 + p] * (B + 1) for p in range(3)]  # B: 3 one-block prefixes, warm, oldest
    for tokens in b_prompts:
        put(cache, tokens, "b")
    a_prompts = [[300 + p] * (B + 1) for p in range(12)]  # A floods 12 one-block prefixes
    for tokens in a_prompts:
        put(cache, tokens, "a")
    # The cache holds 10 blocks: B's 3 (the least recently used of all) stay; A keeps its 7 latest
    # (300..304 went, A's own oldest), as far as the free room let it grow past its 5.
    held = [(block.tenant, unpack_tokens(block.tokens)[0]) for block in cache.store]
    assert sorted(t for tenant, t in held if tenant == "b") == [200, 201, 202]
    assert sorted(t for tenant, t in held if tenant == "a") == list(range(305, 312))
    assert cache.stats().evictions["capacity"] == 5
    cache.check_integrity()


def test_without_a_share_one_lru_evicts_the_other_tenants_oldest_blocks() -> None:
    cache = make(capacity_blocks=10)  # the control: no share, B's older blocks go first
    for p in range(3):
        put(cache, [200 + p] * (B + 1), "b")
    for p in range(12):
        put(cache, [300 + p] * (B + 1), "a")
    held = sorted(unpack_tokens(block.tokens)[0] for block in cache.store)
    assert held == list(range(302, 312))
