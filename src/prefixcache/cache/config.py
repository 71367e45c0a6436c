"""The cache's defaults, in one place, and its lifetime policy (which TTL each block gets).

Every layer that builds or models a cache (the :class:`~prefixcache.cache.PrefixCache`, the
engine, the server's command line, the simulator and audit, the router's record of where
prefixes live, the Redis tier's refresh) takes its defaults from :data:`DEFAULTS`, so changing
a default is one edit here and the tools keep modelling the server they describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How a prefix cache is sized and how long its blocks live.

    ``block_size``: tokens per block, the unit of reuse (a hit ends on a block boundary).
    ``capacity_bytes``: the evictable cache's budget. ``pinned_capacity_bytes``: a separate
    budget for pinned prefixes, which are never evicted. ``default_ttl_s``: how long an unused
    block lives; every hit refreshes it (Anthropic's "5m" class). ``reasons_bytes``: what the
    server's cache spends, out of ``capacity_bytes``, on explaining misses (removed blocks and
    recent prompts; a library ``PrefixCache`` and the simulator keep none unless asked).
    """

    block_size: int = 16
    capacity_bytes: int = 2 << 30
    pinned_capacity_bytes: int = 256 << 20
    default_ttl_s: float = 300.0
    reasons_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {self.block_size}")
        if self.capacity_bytes < 0 or self.pinned_capacity_bytes < 0:
            raise ValueError("capacity_bytes and pinned_capacity_bytes must be >= 0")
        if not self.default_ttl_s > 0:
            raise ValueError(f"default_ttl_s must be > 0; got {self.default_ttl_s}")


#: The defaults of a cache, of the server that holds one and of the tools that model it.
DEFAULTS = CacheConfig()


# ---------------------------------------------------------------- lifetime policy
# Lifetime policy: which TTL each block of a request gets.
#
# Hosted APIs cache with a TTL refreshed on every hit and let a request ask for a longer class
# (Anthropic's ``cache_control: {"ttl": "1h"}`` on a breakpoint covers everything up to it). Two
# rules keep the store's invariants: a block keeps the longest TTL it was ever asked for, and a
# TTL never grows along a chain (a parent outlives its children), so expiry trims chains from
# their tails just as eviction does.

#: (token_end, ttl_s): every block that ends at or before token_end gets at least ttl_s.
TtlPlan = Sequence[tuple[int, float]]

#: The named TTL classes of the APIs the server speaks.
TTL_CLASSES: dict[str, float] = {"5m": 300.0, "1h": 3600.0, "in_memory": 300.0, "24h": 86400.0}


@dataclass(frozen=True, slots=True)
class TtlPolicy:
    """Resolves a request's TTL settings into one TTL per full block."""

    default_ttl_s: float = DEFAULTS.default_ttl_s

    def block_ttls(
        self, n_blocks: int, block_size: int, ttl_s: float | None = None, ttl_plan: TtlPlan | None = None
    ) -> list[float]:
        """TTL for blocks ``0 .. n_blocks-1``; non-increasing along the chain."""
        base = self.default_ttl_s if ttl_s is None else float(ttl_s)
        if base <= 0:
            raise ValueError(f"a TTL must be positive seconds; got {base}")
        ttls = [base] * n_blocks
        if not ttl_plan:
            return ttls
        for token_end, plan_ttl in ttl_plan or ():
            if plan_ttl <= 0:
                raise ValueError(f"a TTL must be positive seconds; got {plan_ttl}")
            covered = min(n_blocks, int(token_end) // block_size)
            for i in range(covered):
                if plan_ttl > ttls[i]:
                    ttls[i] = float(plan_ttl)
        # Suffix maximum: a block never outlives the blocks before it.
        for i in range(n_blocks - 2, -1, -1):
            if ttls[i + 1] > ttls[i]:
                ttls[i] = ttls[i + 1]
        return ttls
