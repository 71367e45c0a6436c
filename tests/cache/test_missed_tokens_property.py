"""``cache_missed_tokens`` over random edits (hypothesis): a cached prompt committed in prefill
chunks as the engine does, then an edit anywhere (a replacement, an insertion, a deletion, so
the prompt's length changes or not): the reason is ``diverged`` at the edit, the read stops at
the last whole block before it, and the missed tokens are :func:`missed_tokens`' figure, the one
docs/server.md defines, whatever the chunking."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cache import FakeClock, PrefixCache
from prefixcache.cache.reasons import Reason, missed_tokens, readable_tokens

B = 4
NB = 100


def make() -> PrefixCache:
    return PrefixCache(
        block_size=B,
        capacity_bytes=1000 * NB + 8192,
        pinned_capacity_bytes=0,
        clock=FakeClock(),
        reasons_bytes=8192,
    )


def commit_in_chunks(cache: PrefixCache, tokens: list[int], chunk: int) -> None:
    ns = cache.namespace("m")
    m = cache.match(tokens, ns)
    for upto in range(chunk, len(tokens) + chunk, chunk):
        cache.commit(m, lambda i: (f"kv{i}", NB), upto_tokens=min(upto, len(tokens)))
    cache.release(m)


@settings(max_examples=300, deadline=None)
@given(
    base=st.lists(st.integers(1, 50), min_size=3 * B + 1, max_size=30 * B),
    chunk_blocks=st.integers(1, 8),
    at=st.floats(0.0, 1.0),
    kind=st.sampled_from(["replace", "insert", "delete"]),
    size=st.integers(1, 6),
)
def test_missed_tokens_after_any_edit(
    base: list[int], chunk_blocks: int, at: float, kind: str, size: int
) -> None:
    cache = make()
    commit_in_chunks(cache, base, chunk_blocks * B)
    i = min(int(at * len(base)), len(base) - 1)
    new = [60 + k for k in range(size)]  # tokens the base never holds: the prompts differ at i
    edited = {
        "replace": base[:i] + new + base[i + size :],
        "insert": base[:i] + new + base[i:],
        "delete": base[:i] + new[:0] + base[i + size :] + [70],
    }[kind]
    if edited[: i + 1] == base[: i + 1] or len(edited) < 2:
        return  # (a deletion at the very end may leave a prefix of the base)
    ns = cache.namespace("m")
    m = cache.match(edited, ns)
    reason = m.reason
    cache.release(m)
    cached = min(i // B * B, readable_tokens(len(edited), B))
    assert m.cached_tokens == cached
    if cached >= readable_tokens(len(edited), B):
        assert reason.reason is Reason.FULL_HIT
        return
    assert reason.reason is Reason.DIVERGED and reason.token_index == i
    assert reason.cache_missed_tokens == missed_tokens(len(base), len(edited), cached, B)
