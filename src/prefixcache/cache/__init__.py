"""The cache layer: block keys, the block store, lifetimes, and the request-facing manager.

Pure Python (no torch): payloads are opaque, so the simulator drives the same code.
"""

from __future__ import annotations

from prefixcache.cache.clock import FakeClock
from prefixcache.cache.config import TTL_CLASSES, TtlPolicy
from prefixcache.cache.keys import (
    KV_LAYOUT_VERSION,
    BlockHash,
    Namespace,
    block_keys,
    model_fingerprint,
    pack_tokens,
    unpack_tokens,
)
from prefixcache.cache.manager import CommitResult, Match, PrefixCache
from prefixcache.cache.pins import TenantPinBudgetExceeded
from prefixcache.cache.stats import CacheStats, Outcome, RequestUsage, Usage
from prefixcache.cache.store import Block, BlockStore, CacheFullError, PinBudgetExceeded
from prefixcache.cache.tiers.base import Tier

__all__ = [
    "KV_LAYOUT_VERSION",
    "TTL_CLASSES",
    "Block",
    "BlockHash",
    "BlockStore",
    "CacheFullError",
    "CacheStats",
    "CommitResult",
    "FakeClock",
    "Match",
    "Namespace",
    "Outcome",
    "PinBudgetExceeded",
    "TenantPinBudgetExceeded",
    "PrefixCache",
    "RequestUsage",
    "Tier",
    "TtlPolicy",
    "Usage",
    "block_keys",
    "model_fingerprint",
    "pack_tokens",
    "unpack_tokens",
]
