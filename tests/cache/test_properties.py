"""Random operation sequences against the cache: integrity after every step, never over budget,
and every hit serves the state of exactly the tokens asked for."""

from __future__ import annotations

import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.cache import CacheFullError, FakeClock, Match, PinBudgetExceeded, PrefixCache

B = 2


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cache = PrefixCache(
            block_size=B, capacity_bytes=12 * 10, pinned_capacity_bytes=4 * 10, default_ttl_s=50, clock=self.clock
        )
        self.namespaces = [self.cache.namespace("m", tenant=t, salt=t) for t in ("a", "b")]
        self.held: list[tuple[Match, list[int]]] = []
        self.pinned: list[tuple[list[int], int]] = []

    prompts = st.lists(st.integers(0, 3), min_size=0, max_size=11)

    def _request(self, tokens: list[int], tenant: int, ttl_long: bool, align: int) -> Match:
        ns = self.namespaces[tenant]
        plan = [(len(tokens) // 2, 200.0)] if ttl_long else None
        m = self.cache.match(tokens, ns, align_tokens=align, ttl_plan=plan)
        # Exactness of what is served: a hit's payload is the token prefix it was computed from.
        for i, block in enumerate(m.blocks):
            assert block.payload == tuple(tokens[: (i + 1) * B]), "a hit served another prompt's state"
        assert m.cached_tokens < max(len(tokens), 1) and m.cached_tokens % align == 0
        self.cache.commit(m, lambda i: (tuple(tokens[: (i + 1) * B]), 10))
        return m

    @rule(tokens=prompts, tenant=st.integers(0, 1), ttl_long=st.booleans(), align=st.sampled_from([2, 4]))
    def request(self, tokens: list[int], tenant: int, ttl_long: bool, align: int) -> None:
        self.cache.release(self._request(tokens, tenant, ttl_long, align))

    @rule(tokens=prompts, tenant=st.integers(0, 1))
    def start_request(self, tokens: list[int], tenant: int) -> None:
        if len(self.held) < 3:
            self.held.append((self._request(tokens, tenant, False, B), tokens))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 2))
    def finish_request(self, i: int) -> None:
        m, _ = self.held.pop(i % len(self.held))
        self.cache.release(m)

    @rule(seconds=st.sampled_from([1, 10, 49, 50, 120, 500]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(tokens=prompts, tenant=st.integers(0, 1))
    def pin(self, tokens: list[int], tenant: int) -> None:
        try:
            n = self.cache.pin(tokens, self.namespaces[tenant])
        except PinBudgetExceeded:
            return
        if n:
            self.pinned.append((tokens, tenant))

    @precondition(lambda self: self.pinned)
    @rule()
    def unpin(self) -> None:
        tokens, tenant = self.pinned.pop()
        try:
            self.cache.unpin(tokens, self.namespaces[tenant])
        except CacheFullError:
            self.pinned.append((tokens, tenant))

    @rule()
    def sweep(self) -> None:
        self.cache.sweep()

    @rule(tenant=st.integers(0, 1))
    def flush(self, tenant: int) -> None:
        self.cache.flush(self.namespaces[tenant])

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()
        store = self.cache.store
        assert store.bytes <= store.capacity_bytes
        assert store.pinned_bytes <= store.pinned_capacity_bytes
        held_blocks = sum(m.held_run is not None for m, _ in self.held)
        assert sum(b.ref_count for b in store) == held_blocks

    def teardown(self) -> None:
        for m, _ in self.held:
            self.cache.release(m)
        self.cache.check_integrity()
        assert all(b.ref_count == 0 for b in self.cache.store)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class CollidingCacheMachine(CacheMachine):
    """The same sequences under a hasher that sees only each block's first token, so distinct
    prompts collide all the time: verification must still never serve the wrong state."""

    def __init__(self) -> None:
        super().__init__()
        weak = lambda prev, block: hashlib.sha256(prev + block[:4]).digest()  # noqa: E731
        self.cache = PrefixCache(
            block_size=B, capacity_bytes=12 * 10, pinned_capacity_bytes=4 * 10, default_ttl_s=50,
            clock=self.clock, hasher=weak,
        )
        self.namespaces = [self.cache.namespace("m", tenant=t, salt=t) for t in ("a", "b")]


TestCollidingCacheMachine = CollidingCacheMachine.TestCase
TestCollidingCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
