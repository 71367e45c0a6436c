"""The cache's defaults, in one place.

Every layer that builds or models a cache (the :class:`~prefixcache.cache.PrefixCache`, the
engine, the server's command line, the simulator and audit, the router's record of where
prefixes live, the Redis tier's refresh) takes its defaults from :data:`DEFAULTS`, so changing
a default is one edit here and the tools keep modelling the server they describe.
"""

from __future__ import annotations

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
