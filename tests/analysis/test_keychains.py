"""KeyChains (shared prefixes hashed once) gives exactly the keys block_keys gives, and the
simulator that uses it (with the store's run insertion) agrees with a plain replay."""

from __future__ import annotations

import numpy as np

from prefixcache.analysis.keychains import KeyChains
from prefixcache.cache import FakeClock, Namespace, PrefixCache, block_keys


def test_keychains_equal_block_keys_for_shared_and_unaligned_parts() -> None:
    rng = np.random.default_rng(3)
    segments = [rng.integers(0, 50_000, n).astype(np.uint32) for n in (0, 5, 16, 37, 160, 1, 33)]
    roots = [Namespace.create("fp", salt=s).root for s in ("a", "b")]
    chains = KeyChains(segments, 16, max_states=7)  # tiny: evictions of states are exercised too
    for _ in range(300):
        parts = tuple(int(x) for x in rng.integers(0, len(segments), int(rng.integers(1, 6))))
        root = roots[int(rng.integers(2))]
        tokens = np.concatenate([segments[j] for j in parts])
        assert chains.keys(root, parts) == block_keys(tokens, root, 16)


def test_commit_with_uniform_nbytes_matches_block_by_block() -> None:
    """The simulator's commit path (room for a run made at once) evicts the same blocks."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 1000, 200).astype(np.uint32)
    prompts = []
    for _ in range(150):
        head = shared[: int(rng.integers(0, 200))]
        prompts.append(np.concatenate([head, rng.integers(0, 1000, int(rng.integers(1, 120))).astype(np.uint32)]))
    results = []
    for uniform in (None, 100):
        clock = FakeClock(0.0)
        cache = PrefixCache(block_size=16, capacity_bytes=100 * 60, pinned_capacity_bytes=0, default_ttl_s=6.0,
                            clock=clock)
        ns = Namespace.create("fp")
        evicted: list[bytes] = []
        cache.store.add_listener(lambda ev, b, log=evicted: log.append(b.key) if ev == "evict" else None)
        out = []
        for i, toks in enumerate(prompts):
            clock.set(clock.now + (8.0 if i % 10 == 0 else 0.3))
            m = cache.match(toks, ns)
            try:
                res = cache.commit(m, lambda _j: (None, 100), uniform_nbytes=uniform)
            finally:
                cache.release(m)
            out.append((m.cached_tokens, res.written_blocks, res.skipped_blocks))
            cache.check_integrity()
        st = cache.stats()
        results.append((out, evicted, st.evictions, st.blocks))
    assert results[0] == results[1]
    assert results[0][2]["capacity"] > 0 and results[0][2]["ttl"] > 0
