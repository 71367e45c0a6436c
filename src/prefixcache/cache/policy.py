"""Lifetime policy: which TTL each block of a request gets.

Hosted APIs cache with a TTL refreshed on every hit and let a request ask for a longer class
(Anthropic's ``cache_control: {"ttl": "1h"}`` on a breakpoint covers everything up to it). Two
rules keep the store's invariants: a block keeps the longest TTL it was ever asked for, and a
TTL never grows along a chain (a parent outlives its children), so expiry trims chains from
their tails just as eviction does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.config import DEFAULTS

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
