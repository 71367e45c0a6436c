"""The run-based store against the block-per-object reference (``block_cache_reference.py``).

Random operation sequences go through both caches (real SHA-256 keys); after every step they must
agree exactly:
each request's hit, writes and skips; which blocks were evicted or expired, in which order, and
why; every counter; every block's parent, tokens, depth, TTL class, last use, references, pins and
children; and the order of the LRU and of every expiry queue (so future victims agree too).

Under forced hash collisions the two differ by design (the reference indexes every block's key,
the run store only each run's first key, so a colliding inner key is a miss instead of a counted
collision); ``test_properties.py`` checks that collisions never serve wrong state.
"""

from __future__ import annotations

from typing import Any

from block_cache_reference import PrefixCache as ReferenceCache
from block_store_reference import CacheFullError as RefCacheFullError
from block_store_reference import PinBudgetExceeded as RefPinBudgetExceeded
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.cache import CacheFullError, FakeClock, PinBudgetExceeded, PrefixCache, pack_tokens

B = 2


def nbytes_of(tokens: list[int], i: int, varied: bool) -> int:
    return 10 + 5 * (tokens[i * B] % 2) if varied else 10


class Differential(RuleBasedStateMachine):
    hasher: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        kw = dict(block_size=B, capacity_bytes=25 * 10, pinned_capacity_bytes=6 * 10, default_ttl_s=50,
                  clock=self.clock, hasher=self.hasher)
        self.ref = ReferenceCache(**kw)
        self.new = PrefixCache(**kw)
        self.events: dict[str, list[tuple[str, bytes, str | None]]] = {"ref": [], "new": []}
        for name, cache in (("ref", self.ref), ("new", self.new)):
            cache.store.add_listener(
                lambda ev, blk, log=self.events[name]: log.append((ev, blk.key, blk.evicted_reason)) if ev == "evict" else None
            )
        self.ns = [(c.namespace("m", tenant=t, salt=t) for c in (self.ref, self.new)) for t in ("a", "b")]
        self.ns = [tuple(pair) for pair in self.ns]
        self.held: list[tuple[Any, Any]] = []
        self.pinned: list[tuple[list[int], int]] = []

    prompts = st.lists(st.integers(0, 2), min_size=0, max_size=26)

    def _request(self, tokens: list[int], tenant: int, plan: int, align: int, varied: bool, upto: int | None,
                 fast: bool) -> tuple[Any, Any]:
        ttl_plan = [(len(tokens) // 2, 200.0)] if plan == 1 else [(len(tokens), 500.0), (4, 900.0)] if plan == 2 else None
        out = []
        for cache, ns in zip((self.ref, self.new), self.ns[tenant], strict=True):
            m = cache.match(tokens, ns, align_tokens=align, ttl_plan=ttl_plan)

            def fn(i: int) -> tuple[tuple[int, ...], int]:
                return tuple(tokens[: (i + 1) * B]), nbytes_of(tokens, i, varied)

            limit = None if upto is None else m.cached_tokens + upto  # as the engine: never below the hit
            if cache is self.new and fast and not varied:
                r = cache.commit(m, None, upto_tokens=limit, uniform_nbytes=10)
            else:
                r = cache.commit(m, fn, upto_tokens=limit, uniform_nbytes=None if varied else 10)
            out.append((m, r))
        (mr, rr), (mn, rn) = out
        fields = ("written_blocks", "written_tokens", "skipped_blocks")
        assert (mn.cached_tokens, mn.outcome) == (mr.cached_tokens, mr.outcome)
        assert [getattr(rn, f) for f in fields] == [getattr(rr, f) for f in fields]
        assert len(mn.written) == len(mr.written) and mn.skipped_blocks == mr.skipped_blocks
        # (payload_fn None stores None payloads: those blocks are compared without them.)
        assert [b.payload for b in mn.blocks if b.payload is not None] == [
            b.payload for b, c in zip(mr.blocks, mn.blocks, strict=True) if c.payload is not None
        ]
        return mr, mn

    @rule(tokens=prompts, tenant=st.integers(0, 1), plan=st.integers(0, 2), align=st.sampled_from([2, 4]),
          varied=st.booleans(), upto=st.one_of(st.none(), st.integers(0, 12)), fast=st.booleans())
    def request(self, tokens: list[int], tenant: int, plan: int, align: int, varied: bool, upto: int | None,
                fast: bool) -> None:
        mr, mn = self._request(tokens, tenant, plan, align, varied, upto, fast)
        self.ref.release(mr)
        self.new.release(mn)

    @rule(tokens=prompts, tenant=st.integers(0, 1), ttl=st.sampled_from([None, 50.0, 200.0]),
          align=st.sampled_from([2, 4]), upto=st.one_of(st.none(), st.integers(0, 26)))
    def replay(self, tokens: list[int], tenant: int, ttl: float | None, align: int, upto: int | None) -> None:
        """``PrefixCache.replay`` (the simulator's one-call request) against match + commit + release."""
        ns_ref, ns_new = self.ns[tenant]
        m = self.ref.match(tokens, ns_ref, align_tokens=align, ttl_s=ttl)
        limit = None if upto is None else max(upto, m.cached_tokens)
        r = self.ref.commit(m, lambda i: (None, 10), upto_tokens=limit, uniform_nbytes=10)
        self.ref.release(m)
        keys = self.new.block_keys(tokens, ns_new)
        got = self.new.replay(ns_new, keys, pack_tokens(tokens), nbytes=10, ttl_s=ttl, align_tokens=align,
                              upto_tokens=limit)
        assert got == (m.cached_tokens, r.written_tokens)

    @rule(tokens=prompts, tenant=st.integers(0, 1))
    def start_request(self, tokens: list[int], tenant: int) -> None:
        if len(self.held) < 3:
            self.held.append(self._request(tokens, tenant, 0, B, False, None, False))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 2))
    def finish_request(self, i: int) -> None:
        mr, mn = self.held.pop(i % len(self.held))
        self.ref.release(mr)
        self.new.release(mn)

    @rule(seconds=st.sampled_from([1, 10, 49, 50, 120, 500]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(tokens=prompts, tenant=st.integers(0, 1))
    def pin(self, tokens: list[int], tenant: int) -> None:
        results = []
        for cache, ns in zip((self.ref, self.new), self.ns[tenant], strict=True):
            try:
                results.append(cache.pin(tokens, ns))
            except (PinBudgetExceeded, RefPinBudgetExceeded):
                results.append("budget")
        assert results[0] == results[1]
        if isinstance(results[0], int) and results[0]:
            self.pinned.append((tokens, tenant))

    @precondition(lambda self: self.pinned)
    @rule()
    def unpin(self) -> None:
        tokens, tenant = self.pinned.pop()
        results = []
        for cache, ns in zip((self.ref, self.new), self.ns[tenant], strict=True):
            try:
                results.append(cache.unpin(tokens, ns))
            except (CacheFullError, RefCacheFullError):
                results.append("full")
        assert results[0] == results[1]
        if results[0] == "full":
            self.pinned.append((tokens, tenant))

    @rule()
    def sweep(self) -> None:
        assert self.ref.sweep() == self.new.sweep()

    @rule(tenant=st.integers(0, 1))
    def flush(self, tenant: int) -> None:
        n_ref = len(self.events["ref"])
        n_new = len(self.events["new"])
        assert self.ref.flush(self.ns[tenant][0]) == self.new.flush(self.ns[tenant][1])
        # Among blocks of equal depth the flush order is unspecified: compare as sets.
        assert sorted(self.events["ref"][n_ref:]) == sorted(self.events["new"][n_new:])
        self.events["new"][n_new:] = self.events["ref"][n_ref:]

    @invariant()
    def agree(self) -> None:
        self.new.check_integrity()
        assert self.events["new"] == self.events["ref"]
        sr, sn = self.ref.stats().as_dict(), self.new.stats().as_dict()
        assert sn == sr, {k: (sr[k], sn[k]) for k in sr if sr[k] != sn[k]}
        rs, ns = self.ref.store, self.new.store
        state_ref = {
            b.key: (b.parent, b.tokens, b.depth, b.ttl_s, b.last_used, b.ref_count, b.pin_count, b.n_children, b.payload)
            for b in rs
        }
        state_new = {
            b.key: (b.parent, b.tokens, b.depth, b.ttl_s, b.last_used, b.ref_count, b.pin_count, b.n_children, b.payload)
            for b in ns
        }
        # An inner block of a run reports its run's last use, which is what it inherits when it
        # becomes a leaf; the reference keeps its own (older) time, never read while it has a child.
        for key, v in state_ref.items():
            w = state_new.get(key)
            assert w is not None, "a block is missing"
            if w[8] is None:
                v = v[:8] + (None,)
            if v[7]:  # has children: compare all but the last use
                assert v[:4] + v[5:] == w[:4] + w[5:]
                assert w[4] >= v[4]
            else:
                assert v == w
        assert set(state_new) == set(state_ref)
        assert ns.lru_order() == rs.lru_order()
        expiry_new = ns.expiry_order()
        for ttl, queue in rs.expiry_order().items():
            assert expiry_new.get(ttl, []) == queue
        assert (ns.bytes, ns.pinned_bytes, ns.pinned_blocks) == (rs.bytes, rs.pinned_bytes, rs.pinned_blocks)

    def teardown(self) -> None:
        for mr, mn in self.held:
            self.ref.release(mr)
            self.new.release(mn)
        self.agree()


TestDifferential = Differential.TestCase
TestDifferential.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)


def test_both_stores_expire_a_leaf_queued_behind_later_leaves_on_time() -> None:
    """The late-heap fix, in both stores: a prefix touched below its child becomes a leaf after
    the child expires, behind a leaf that expires later; at its own expiry it is gone."""
    for cls in (ReferenceCache, PrefixCache):
        clock = FakeClock()
        cache = cls(block_size=4, capacity_bytes=1000, pinned_capacity_bytes=0, default_ttl_s=300, clock=clock)
        ns = cache.namespace("m")

        def req(tokens: list[int], at: float, cache: Any = cache, ns: Any = ns, clock: FakeClock = clock) -> int:
            clock.set(at)
            m = cache.match(tokens, ns)
            cache.commit(m, lambda i: (None, 10))
            cache.release(m)
            cache.check_integrity()
            return m.cached_tokens

        p = list(range(8))
        req([*p, 100], 0)
        req([*p, 1, 2, 3, 4, 101], 10)  # P's child
        req([50, 51, 52, 53, 102], 50)  # due at 350
        assert req([*p, 103], 100) == 8  # P touched below its child
        req([60, 61, 62, 63, 104], 200)  # due at 500
        req([70, 71, 72, 73, 105], 320)  # the child has expired: P is a leaf, due at 400
        assert req([*p, 106], 450) == 0, cls.__module__
