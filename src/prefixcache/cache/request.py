"""What a request gets back from :class:`~prefixcache.cache.manager.PrefixCache`: a :class:`Match`
(its view of the cache from ``match`` to ``release``) and a :class:`CommitResult`.

A Match's underscored fields are the cache's bookkeeping: PrefixCache sets them under its lock,
and nothing else should (:attr:`Match.held_run` and :attr:`Match.depth` read them). A Match reads
the cache's blocks through :class:`BlockSource`, so this module does not know the manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prefixcache.cache.blocks import Block, Run
from prefixcache.cache.keys import BlockHash, Namespace
from prefixcache.cache.reasons import CacheReason
from prefixcache.cache.stats import Outcome, RequestUsage

__all__ = ["BlockSource", "CommitResult", "Match"]


class BlockSource(Protocol):
    """What a :class:`Match` reads its blocks through (the cache that made it)."""

    def snapshots(self, keys: Sequence[BlockHash], *, missing_ok: bool = False) -> list[Block]: ...


@dataclass(slots=True, eq=False)
class Match:
    """One request's view of the cache, from :meth:`PrefixCache.match` to ``release``."""

    namespace: Namespace
    prompt_tokens: int
    keys: list[BlockHash]  # every full block of the prompt
    ttls: list[float]  # the TTL each full block is stored or refreshed with
    packed: bytes = field(repr=False)
    block_size: int = 16
    outcome: Outcome = Outcome.MISS
    cached_blocks: int = 0  # the cached prefix: keys[:cached_blocks]
    reason: CacheReason | None = None  # why the read ended there (see cache/reasons.py)
    written_keys: list[BlockHash] = field(default_factory=list)  # blocks this request stored
    skipped_blocks: int = 0
    released: bool = False
    _cache: BlockSource | None = field(default=None, repr=False)
    _held: Run | None = field(default=None, repr=False)  # the run whose tail (our deepest block) we hold
    _depth: int = 0  # blocks of the prompt covered by _held's chain

    @property
    def held_run(self) -> Run | None:
        """The run whose tail (the deepest block of the prompt this request holds) is referenced
        for it: None before a hit or a write, and after release."""
        return self._held

    @property
    def depth(self) -> int:
        """Blocks of the prompt covered by the chain held (:attr:`held_run`'s)."""
        return self._depth

    @property
    def cached_tokens(self) -> int:
        return self.cached_blocks * self.block_size

    @property
    def blocks(self) -> list[Block]:
        """Snapshots of the cached prefix's blocks, in order (payloads included). Read them
        before :meth:`PrefixCache.release`: until then the prefix cannot be evicted."""
        if self._cache is None or not self.cached_blocks:
            return []
        return self._cache.snapshots(self.keys[: self.cached_blocks])

    @property
    def written(self) -> list[Block]:
        """Snapshots of the blocks this request stored (those still cached)."""
        return [] if self._cache is None else self._cache.snapshots(self.written_keys, missing_ok=True)

    @property
    def usage(self) -> RequestUsage:
        return RequestUsage(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_blocks * self.block_size,
            cache_write_tokens=len(self.written_keys) * self.block_size,
            cache_reason=self.reason,
        )


@dataclass(frozen=True, slots=True)
class CommitResult:
    written_blocks: int
    written_tokens: int
    skipped_blocks: int  # full blocks that could not be stored (no room)
