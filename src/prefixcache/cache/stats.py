"""Counters in tokens and bytes, the per-request usage record, and the cache's stats snapshot."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Protocol

from prefixcache.cache.blocks import StoreCounters
from prefixcache.cache.reasons import CacheReason


class Outcome(StrEnum):
    """How much of a request's cacheable prefix was served from the cache."""

    HIT = "hit"  # every full block the request could reuse was cached
    PARTIAL = "partial"  # some leading blocks were cached
    MISS = "miss"  # none


@dataclass(slots=True)
class Usage:
    """A request's accounting in tokens, the one usage record of the project (cache, engine and
    server). ``cached_tokens`` were read from the cache (not prefilled); ``cache_write_tokens``
    were prefilled and stored; the rest of ``prompt_tokens`` was prefilled and not stored.
    ``completion_tokens`` were generated (an EOS that ended the generation counts, as in
    OpenAI's usage); the cache, which sees only prompts, leaves it at 0. ``cache_reason``: why
    the cache read ended where it did (None where no cache was asked)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    completion_tokens: int = 0
    cache_reason: CacheReason | None = field(default=None, compare=False)  # (equality: the counts)

    @property
    def uncached_unwritten_tokens(self) -> int:
        """Anthropic's ``input_tokens``: neither read from nor written to the cache."""
        return max(self.prompt_tokens - self.cached_tokens - self.cache_write_tokens, 0)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


#: The cache's name for :class:`Usage` (the same type).
RequestUsage = Usage


@dataclass(slots=True)
class TenantCounters:
    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    written_tokens: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in Outcome})

    def add(self, usage: RequestUsage, outcome: Outcome) -> None:
        self.count(usage.prompt_tokens, usage.cached_tokens, outcome.value)

    def count(self, prompt_tokens: int, cached_tokens: int, outcome: str) -> None:
        self.requests += 1
        self.queried_tokens += prompt_tokens
        self.hit_tokens += cached_tokens
        self.outcomes[outcome] += 1


@dataclass(slots=True)
class CacheStats:
    """A snapshot of the cache: traffic counters and what is held now."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    written_tokens: int = 0
    blocks: int = 0
    bytes: int = 0
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    capacity_bytes: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    expirations: int = 0
    collisions: int = 0
    hits_by_outcome: dict[str, int] = field(default_factory=dict)
    tier_hits: int = 0
    tenant: str | None = None

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens read from the cache."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


def summed(tenants: Iterable[TenantCounters]) -> TenantCounters:
    """Every tenant's counters summed (the cache's totals: one count per request, not two)."""
    totals = TenantCounters()
    for counters in tenants:
        totals.requests += counters.requests
        totals.queried_tokens += counters.queried_tokens
        totals.hit_tokens += counters.hit_tokens
        totals.written_tokens += counters.written_tokens
        for outcome, requests in counters.outcomes.items():
            totals.outcomes[outcome] += requests
    return totals


class Holdings(Protocol):
    """What :func:`cache_stats` reads of the store (:class:`~prefixcache.cache.store.BlockStore`)."""

    @property
    def bytes(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...
    @property
    def pinned_blocks(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def tenant_blocks(self) -> dict[str, int]: ...
    @property
    def tenant_bytes(self) -> dict[str, int]: ...
    @property
    def counters(self) -> StoreCounters: ...
    def __len__(self) -> int: ...


def cache_stats(
    tenants: Mapping[str, TenantCounters], store: Holdings, tier_hits: int, tenant: str | None = None
) -> CacheStats:
    """The snapshot of a cache: one tenant's traffic (None: every tenant's, summed) and what the
    store holds for it, with the store's evictions and collisions and the blocks promoted from
    the tiers (``tier_hits``). The caller holds the cache's lock."""
    counters = summed(tenants.values()) if tenant is None else tenants.get(tenant, TenantCounters())
    evictions = dict(store.counters.evictions)
    if tenant is None:
        blocks, held_bytes = len(store), store.bytes + store.pinned_bytes
    else:
        blocks, held_bytes = store.tenant_blocks.get(tenant, 0), store.tenant_bytes.get(tenant, 0)
    return CacheStats(
        requests=counters.requests,
        queried_tokens=counters.queried_tokens,
        hit_tokens=counters.hit_tokens,
        written_tokens=counters.written_tokens,
        blocks=blocks,
        bytes=held_bytes,
        pinned_blocks=store.pinned_blocks,
        pinned_bytes=store.pinned_bytes,
        capacity_bytes=store.capacity_bytes,
        evictions=evictions,
        expirations=evictions.get("ttl", 0),
        collisions=store.counters.collisions,
        hits_by_outcome=dict(counters.outcomes),
        tier_hits=tier_hits,
        tenant=tenant,
    )
