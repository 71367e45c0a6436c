"""Miss reasons: every reason provoked on purpose on the cache alone, with the exact block, token
index and missed tokens; the ghost record and recent prompts stay within their byte budget."""

from __future__ import annotations

import tracemalloc

from prefixcache.cache import FakeClock, PrefixCache
from prefixcache.cache.ghosts import GHOST_ENTRY_BYTES, GhostRecord, RecentPrompts
from prefixcache.cache.reasons import CONTEXT_TOKENS, Reason

B = 4
NB = 100
REASONS = 4096  # bytes for the ghost record and recent prompts


def make(capacity_blocks: int = 100, ttl: float = 300.0) -> tuple[PrefixCache, FakeClock]:
    clock = FakeClock()
    cache = PrefixCache(
        block_size=B,
        capacity_bytes=capacity_blocks * NB + REASONS,
        pinned_capacity_bytes=0,
        default_ttl_s=ttl,
        clock=clock,
        reasons_bytes=REASONS,
    )
    return cache, clock


def run(cache: PrefixCache, tokens: list[int], salt: bytes = b"", **kw: object):
    ns = cache.namespace("m", salt=salt)
    m = cache.match(tokens, ns, **kw)  # type: ignore[arg-type]
    cache.commit(m, lambda i: (f"kv{i}", NB))
    cache.release(m)
    cache.check_integrity()
    return m


def test_budget_is_taken_out_of_capacity() -> None:
    cache, _ = make(capacity_blocks=10)
    assert cache.store.capacity_bytes == 10 * NB
    assert cache.stats().capacity_bytes == 10 * NB


def test_below_minimum_and_full_hit() -> None:
    cache, _ = make()
    assert run(cache, [1, 2, 3]).reason.reason is Reason.BELOW_MINIMUM  # no full block
    assert (
        run(cache, [1, 2, 3, 4]).reason.reason is Reason.BELOW_MINIMUM
    )  # the one block holds the last token
    prompt = list(range(1, 14))  # 3 full blocks, all readable
    first = run(cache, prompt).reason
    assert (first.reason, first.cache_missed_tokens) == (Reason.NEW_PREFIX, 0)
    again = run(cache, prompt)
    assert again.cached_tokens == 12 and again.reason.reason is Reason.FULL_HIT
    assert again.usage.cache_reason is again.reason
    # A 12-token prompt may read 2 blocks (its last token is computed): reading both is a full hit.
    assert run(cache, prompt[:12]).reason.reason is Reason.FULL_HIT


def test_expired_names_the_block_and_how_long_ago() -> None:
    cache, clock = make(ttl=10.0)
    prompt = list(range(1, 22))  # 5 full blocks
    run(cache, prompt)
    clock.advance(25.0)  # expired 15 s ago
    m = run(cache, prompt)
    assert m.cached_tokens == 0
    assert m.reason.reason is Reason.EXPIRED
    assert m.reason.ago_s == 15.0
    assert m.reason.cache_missed_tokens == 20


def test_evicted_under_a_small_budget() -> None:
    cache, clock = make(capacity_blocks=4)
    a = [1] * 17  # 4 blocks
    run(cache, a)
    clock.advance(1)
    run(cache, [2] * 9)  # 2 blocks: evicts a's last two
    clock.advance(1)
    m = run(cache, a)
    assert m.cached_tokens == 8
    assert (m.reason.reason, m.reason.cache_missed_tokens, m.reason.ago_s) == (Reason.EVICTED, 8, 1.0)


def test_flushed() -> None:
    cache, clock = make()
    prompt = list(range(30, 43))
    run(cache, prompt)
    assert cache.flush(cache.namespace("m")) == 3
    clock.advance(2)
    m = run(cache, prompt)
    assert (m.reason.reason, m.reason.cache_missed_tokens, m.reason.ago_s) == (Reason.FLUSHED, 12, 2.0)


def test_diverged_inside_a_live_run_reports_the_token() -> None:
    cache, _ = make()
    prompt = list(range(100, 141))  # 10 full blocks
    run(cache, prompt)
    changed = list(prompt)
    changed[22] = 7  # block 5, third token
    m = run(cache, changed)
    r = m.reason
    assert m.cached_tokens == 20
    assert (r.reason, r.token_index) == (Reason.DIVERGED, 22)
    assert r.cache_missed_tokens == 40 - 20  # the cached prompt's 10 blocks would have been read
    assert r.before == tuple(prompt[22 - CONTEXT_TOKENS : 22])
    assert r.prompt_after == tuple(changed[22 : 22 + CONTEXT_TOKENS])
    assert r.cached_after == tuple(prompt[22 : 22 + CONTEXT_TOKENS])


def test_diverged_at_the_top_finds_the_recent_prompt() -> None:
    cache, _ = make()
    base = [5, 6, 7, 8, 9, 10, 11] + list(range(200, 230))
    run(cache, [1, 2, 900] + base)  # a "timestamp" at token 2
    m = run(cache, [1, 2, 901] + base)
    assert m.cached_tokens == 0
    assert (m.reason.reason, m.reason.token_index) == (Reason.DIVERGED, 2)
    assert m.reason.cached_after[0] == 900 and m.reason.prompt_after[0] == 901
    assert m.reason.cache_missed_tokens == 36


def test_diverged_at_a_fork_between_runs() -> None:
    cache, _ = make()
    shared = list(range(1, 17))  # 4 blocks
    run(cache, shared + [50] * 9)
    run(cache, shared + [60] * 9)  # a second branch after block 3
    m = run(cache, shared + [60, 60, 61] + [0] * 6)
    assert m.cached_tokens == 16
    assert (m.reason.reason, m.reason.token_index) == (Reason.DIVERGED, 18)


def test_new_turn_after_the_cached_prompt_is_new_prefix() -> None:
    cache, _ = make()
    turn1 = list(range(1, 15))  # 3 full blocks + 2 tokens
    run(cache, turn1)
    m = run(cache, turn1 + list(range(300, 320)))
    assert m.cached_tokens == 12
    assert (m.reason.reason, m.reason.cache_missed_tokens) == (Reason.NEW_PREFIX, 0)


def test_reasons_never_see_another_tenant() -> None:
    cache, clock = make(ttl=10.0)
    prompt = list(range(1, 22))
    run(cache, prompt, salt=b"alice")
    clock.advance(30)
    cache.sweep()  # alice's blocks expire: ghosts of alice's namespace
    bob = run(cache, prompt, salt=b"bob")
    assert (bob.reason.reason, bob.reason.token_index) == (Reason.NEW_PREFIX, None)
    changed = [0] + prompt[1:]
    bob2 = run(cache, [1, 2, 3, 4, 5] + [9] * 12, salt=b"bob2")
    assert bob2.reason.reason is Reason.NEW_PREFIX  # alice's recent prompt is not bob2's
    assert run(cache, changed, salt=b"alice").reason.reason is Reason.DIVERGED


def test_without_a_reasons_budget_only_live_facts() -> None:
    clock = FakeClock()
    cache = PrefixCache(block_size=B, capacity_bytes=100 * NB, default_ttl_s=10.0, clock=clock)
    prompt = list(range(1, 22))
    run(cache, prompt)
    assert run(cache, prompt).reason.reason is Reason.FULL_HIT
    clock.advance(30)
    assert run(cache, prompt).reason.reason is Reason.NEW_PREFIX  # no ghost record to remember it


def test_ghost_record_stays_within_its_bytes() -> None:
    budget = 64 * GHOST_ENTRY_BYTES
    ghosts = GhostRecord(budget, FakeClock())
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(10_000):
            ghosts.on_removal(
                [i.to_bytes(32, "big")], b"ns", "capacity", 1.0
            )  # one Ghost each: the worst case
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ghosts) == 64 and ghosts.nbytes == budget
    assert held - base <= budget  # the estimate per entry covers what an entry really costs
    assert ghosts.get((9_999).to_bytes(32, "big"), b"ns") is not None
    assert ghosts.get((0).to_bytes(32, "big"), b"ns") is None  # the oldest went first
    assert ghosts.get((9_999).to_bytes(32, "big"), b"other") is None


def test_recent_prompts_stay_within_their_bytes() -> None:
    recent = RecentPrompts(4000, per_namespace=3)
    for i in range(200):
        recent.add(bytes([i % 7]) * 8, bytes([i % 251]) * 32, bytes([i % 251]) * 400)
        assert recent.nbytes <= 4000
    assert len(recent) == 6  # 656 bytes each: six fit
    for i in range(5):
        recent.add(b"ns", bytes([i]) * 32, bytes([i]) * 40)
    assert recent.of(b"ns") == [bytes([4]) * 40, bytes([3]) * 40, bytes([2]) * 40]
    recent.add(b"ns", bytes([3]) * 32, bytes([3]) * 44)  # same full blocks, a longer tail: replaced
    assert recent.of(b"ns") == [bytes([3]) * 44, bytes([4]) * 40, bytes([2]) * 40]
    assert (recent.nbytes, len(recent)) == (4 * 656 + 2 * 296 + 300, 7)  # 4 large prompts, 3 small


def test_ghosts_through_a_busy_cache_stay_bounded() -> None:
    cache, clock = make(capacity_blocks=8)
    for i in range(500):
        run(cache, [i] * 9)
        clock.advance(1)
    assert cache.ghosts is not None and len(cache.ghosts) == cache.ghosts.max_entries
    assert cache.ghosts.nbytes + cache.recent.nbytes <= REASONS  # type: ignore[union-attr]


def test_explain_off_gives_no_reason() -> None:
    cache = PrefixCache(block_size=B, capacity_bytes=100 * NB, explain=False)
    m = run(cache, list(range(1, 22)))
    assert m.reason is None and m.usage.cache_reason is None


def test_diverged_inside_a_live_run_needs_no_record() -> None:
    cache = PrefixCache(block_size=B, capacity_bytes=100 * NB)  # no ghosts, no recent prompts
    prompt = list(range(100, 141))
    run(cache, prompt)
    changed = list(prompt)
    changed[22] = 7
    m = run(cache, changed)
    assert (m.reason.reason, m.reason.token_index, m.reason.cache_missed_tokens) == (Reason.DIVERGED, 22, 20)
    assert m.reason.cached_after == tuple(prompt[22 : 22 + CONTEXT_TOKENS])
