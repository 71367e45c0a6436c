"""``tier_unavailable``: the shared tier cannot be reached during the lookup (a real Redis client
against a closed loopback port), so the read ends short for that reason, not as a new prefix."""

from __future__ import annotations

import socket

from prefixcache.cache import Namespace, PrefixCache
from prefixcache.cache.reasons import Reason
from prefixcache.cache.tiers import RedisTier

B = 4
NS = Namespace.create("tiny|float32|B4|kv1", tenant="t", salt=b"s")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_tier_is_named_and_a_reachable_miss_is_not() -> None:
    cache = PrefixCache(block_size=B, capacity_bytes=1 << 20, reasons_bytes=1 << 12)
    tier = RedisTier(f"redis://127.0.0.1:{closed_port()}/0", sync_writes=True)
    cache.add_tier(tier)
    try:
        m = cache.match(list(range(1, 22)), NS)
        cache.release(m)
        assert m.cached_tokens == 0
        assert m.reason is not None and m.reason.reason is Reason.TIER_UNAVAILABLE
        assert tier.stats().errors + tier.stats().skipped >= 1
        # The breaker is open now: the next lookup skips the tier, still unavailable.
        m = cache.match(list(range(50, 71)), NS)
        cache.release(m)
        assert m.reason.reason is Reason.TIER_UNAVAILABLE
    finally:
        tier.close()
    plain = PrefixCache(block_size=B, capacity_bytes=1 << 20, reasons_bytes=1 << 12)
    m = plain.match(list(range(1, 22)), NS)
    plain.release(m)
    assert m.reason.reason is Reason.NEW_PREFIX
