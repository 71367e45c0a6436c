"""KeyChains: chained block keys of segmented prompts (fingerprints by default, SHA-256 on
request), resuming from the chain states of shared prefixes; and the simulator's commit path."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from prefixcache.analysis.trace.keychains import _MIX_ADD, _MIX_MUL, _P, KeyChains
from prefixcache.cache import FakeClock, Namespace, PrefixCache, block_keys

_M = (1 << 64) - 1


def _reference(root: bytes, tokens: np.ndarray, B: int) -> list[bytes]:
    """The fingerprint of the module docstring, token by token in plain Python."""
    d = hashlib.sha256(b"keychains-root\x00" + root).digest()
    h = [int.from_bytes(d[:8], "little"), int.from_bytes(d[8:16], "little")]
    pw = [1, 1]
    out = []
    for p, t in enumerate(tokens.tolist(), 1):
        x = (t + int(_MIX_ADD)) * int(_MIX_MUL) & _M
        x ^= x >> 33
        for lane in (0, 1):
            h[lane] = (h[lane] + x * pw[lane]) & _M
            pw[lane] = pw[lane] * _P[lane] & _M
        if p % B == 0:
            out.append(h[0].to_bytes(8, "little") + h[1].to_bytes(8, "little"))
    return out


def _random_requests(
    rng: np.random.Generator, segments: list[np.ndarray], roots: list[bytes], n: int
) -> list:
    return [
        (
            roots[int(rng.integers(len(roots)))],
            tuple(int(x) for x in rng.integers(0, len(segments), int(rng.integers(1, 6)))),
        )
        for _ in range(n)
    ]


@pytest.fixture
def segments() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [
        rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32) for n in (0, 5, 16, 37, 160, 1, 33)
    ]


def test_sha256_keychains_equal_block_keys_for_shared_and_unaligned_parts(segments: list[np.ndarray]) -> None:
    rng = np.random.default_rng(3)
    roots = [Namespace.create("fp", salt=s).root for s in ("a", "b")]
    chains = KeyChains(segments, 16, max_states=7)  # sha256 by default; tiny: evictions of states too
    for root, parts in _random_requests(rng, segments, roots, 300):
        tokens = np.concatenate([segments[j] for j in parts])
        assert chains.keys(root, parts) == block_keys(tokens, root, 16) == chains.token_keys(root, tokens)


@pytest.mark.parametrize("max_states", [0, 7, 100_000])
def test_fingerprints_match_the_documented_formula(segments: list[np.ndarray], max_states: int) -> None:
    """Resuming from states (many, few, none kept), in batches or one by one, changes nothing."""
    rng = np.random.default_rng(4)
    roots = [Namespace.create("fp", salt=s).root for s in ("a", "b")]
    reqs = _random_requests(rng, segments, roots, 300)
    batched = list(KeyChains(segments, 16, max_states=max_states, hasher="fingerprint").iter_keys(reqs))
    single = KeyChains(segments, 16, max_states=max_states, hasher="fingerprint")
    for (root, parts), keys in zip(reqs, batched, strict=True):
        tokens = np.concatenate([segments[j] for j in parts])
        assert (
            keys
            == _reference(root, tokens, 16)
            == single.keys(root, parts)
            == single.token_keys(root, tokens)
        )
        assert all(type(k) is bytes and len(k) == 16 for k in keys) and len(keys) == len(tokens) // 16


def test_equal_prefixes_equal_keys_across_segmentations_and_instances() -> None:
    rng = np.random.default_rng(7)
    x = rng.integers(0, 50_000, 1000).astype(np.uint32)
    cuts = [(0, 1000), (0, 3, 1000), (0, 16, 17, 500, 999, 1000), (0, 400, 401, 1000)]
    segments, splits = [], []
    for c in cuts:
        splits.append(tuple(range(len(segments), len(segments) + len(c) - 1)))
        segments += [x[a:b] for a, b in zip(c, c[1:], strict=False)]
    root = Namespace.create("fp").root
    chains = KeyChains(segments, 16, hasher="fingerprint")
    want = chains.keys(root, splits[0])
    assert len(want) == 62 and len(set(want)) == 62
    for parts in splits[1:]:
        assert chains.keys(root, parts) == want
        assert (
            KeyChains(segments, 16, hasher="fingerprint").keys(root, parts) == want
        )  # deterministic across instances
    # A prompt that extends another shares its keys as far as it goes.
    assert chains.keys(root, splits[2][:3]) == want[:31]


def test_keys_differ_for_different_prefixes_and_namespaces() -> None:
    rng = np.random.default_rng(8)
    a = rng.integers(0, 50_000, 640).astype(np.uint32)
    b = a.copy()
    b[100] += 1  # block 6
    c = a.copy()
    c[100], c[101] = a[101], a[100]  # a swap inside block 6
    segments = [a, b, c, a[:100], a[100:], np.zeros(16, np.uint32), np.zeros(32, np.uint32)]
    r1, r2 = Namespace.create("fp", salt="x").root, Namespace.create("fp", salt="y").root
    chains = KeyChains(segments, 16, hasher="fingerprint")
    ka, kb, kc = (chains.keys(r1, (i,)) for i in range(3))
    for other in (kb, kc) if a[100] != a[101] else (kb,):
        assert other[:6] == ka[:6]
        assert all(x != y for x, y in zip(other[6:], ka[6:], strict=True))
    assert chains.keys(r1, (3, 4)) == ka
    assert not set(chains.keys(r2, (0,))) & set(ka)  # same tokens, other namespace: no key shared
    zeros = chains.keys(r1, (6,))
    assert zeros[0] == chains.keys(r1, (5,))[0] and zeros[1] != zeros[0]  # a zero block still moves the chain
    seen = set()
    for i in range(3):
        seen.update(chains.keys(r1, (i,)) + chains.keys(r2, (i,)))
    assert len(seen) == 2 * (40 + 34 + (34 if a[100] != a[101] else 0))


def test_long_prompts_grow_the_power_tables() -> None:
    rng = np.random.default_rng(9)
    x = rng.integers(0, 1 << 32, 150_000, dtype=np.uint64).astype(np.uint32)
    segments = [x, x[:70_001], x[70_001:140_000], x[140_000:]]
    root = Namespace.create("fp").root
    one = KeyChains(segments, 16, hasher="fingerprint").keys(root, (0,))
    assert KeyChains(segments, 16, hasher="fingerprint").keys(root, (1, 2, 3)) == one
    assert one[-1] == _reference(root, x, 16)[-1]


def test_unknown_hasher_is_rejected() -> None:
    with pytest.raises(ValueError, match="hasher"):
        KeyChains([], 16, hasher="md5")


def test_commit_with_uniform_nbytes_matches_block_by_block() -> None:
    """The simulator's commit path (room for a run made at once) evicts the same blocks."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 1000, 200).astype(np.uint32)
    prompts = []
    for _ in range(150):
        head = shared[: int(rng.integers(0, 200))]
        prompts.append(
            np.concatenate([head, rng.integers(0, 1000, int(rng.integers(1, 120))).astype(np.uint32)])
        )
    results = []
    for uniform in (None, 100):
        clock = FakeClock(0.0)
        cache = PrefixCache(
            block_size=16, capacity_bytes=100 * 60, pinned_capacity_bytes=0, default_ttl_s=6.0, clock=clock
        )
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
