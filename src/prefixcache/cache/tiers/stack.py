"""TierStack: the tiers below one in-memory store, and the three ways blocks cross between them.

* **promote**: a lookup that ends short in memory continues in the tiers, in order (disk, then
  Redis); what they hold, verified, is inserted into the store as if computed.
* **write-through**: blocks a commit stored go at once to every tier with ``write_through``.
* **demote**: blocks evicted from memory for capacity go to every tier without it (a spill tier).
* **remove a namespace**: a tenant's flush reaches every tier (:meth:`TierStack.remove_namespace`).

``layout`` (set by an engine, :meth:`~prefixcache.cache.manager.PrefixCache.set_block_layout`)
is the payload shape and dtype a promoted block must have: anything else is refused by the tier.

:class:`~prefixcache.cache.manager.PrefixCache` owns one stack and calls it while holding its lock;
the stack reaches the store through its public methods only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixcache.cache.blocks import Block, Chain
from prefixcache.cache.keys import BlockHash
from prefixcache.cache.store import BlockStore
from prefixcache.cache.tiers.base import Tier
from prefixcache.cache.tiers.codec import BlockLayout


class TierStack:
    """The tiers below ``store``, in lookup order. Not thread-safe: the cache's lock covers it."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.tiers: list[Tier] = []
        self.promoted_blocks = 0  # blocks brought up from the tiers (``CacheStats.tier_hits``)
        #: Whether a tier failed (or was skipped by its breaker) during the last :meth:`promote`.
        self.unavailable = False
        self.layout: BlockLayout | None = None  # what a promoted payload must be (None: unchecked)

    def add(self, tier: Tier) -> None:
        """Add ``tier`` below the others. The first write-back tier starts the store's eviction feed."""
        if not tier.write_through and all(other.write_through for other in self.tiers):
            self.store.add_listener(self._demote)
        self.tiers.append(tier)

    def promote(self, chain: Chain, start: int, stop: int, adopt: Callable[[Any], Any] | None) -> int:
        """Bring blocks ``start..stop-1`` of ``chain`` up from the tiers into the store, as
        far as the tiers hold them in a row (block ``start - 1`` must be stored). Each is queued as
        a leaf. ``adopt`` turns a tier's payload into the engine's own kind (None keeps it).
        Returns how many came up; sets :attr:`unavailable`."""
        got, unavailable = self.read(chain, start, stop)
        self.unavailable = unavailable
        return self.insert(chain, start, got, adopt)

    def read(self, chain: Chain, start: int, stop: int) -> tuple[list[tuple[Any, int]], bool]:
        """The tier I/O of :meth:`promote`, touching no store (call it without the cache's lock):
        the (payload, nbytes) of blocks ``start..`` of ``chain``, as far as the tiers hold
        them in a row (each tier continues where the one above stopped), each verified by its
        tier as :meth:`promote` does; and whether a tier failed or was skipped by its breaker."""
        keys, packed, step, namespace = chain.keys, chain.packed, chain.step, chain.namespace
        out: list[tuple[Any, int]] = []
        unavailable = False
        for tier in list(self.tiers):
            first = start + len(out)
            if first >= stop:
                break
            tokens = [packed[index * step : (index + 1) * step] for index in range(first, stop)]
            before = tier.stats()
            got = tier.get_many(keys[first:stop], tokens, namespace, self.layout)
            after = tier.stats()
            if after.errors + after.skipped > before.errors + before.skipped:
                unavailable = True
            out.extend(got)
        return out, unavailable

    def insert(
        self, chain: Chain, start: int, got: list[tuple[Any, int]], adopt: Callable[[Any], Any] | None
    ) -> int:
        """Insert blocks ``start..`` read by :meth:`read` into the store (block ``start - 1``
        must be stored), each queued as a leaf, stopping at the first the store refuses.
        Returns how many went in."""
        at = start
        for payload, nbytes in got:
            if adopt is not None:
                payload = adopt(payload)
            inserted, _, _ = self.store.insert_chain(
                chain, at, at + 1, None, _constant_payload(payload, nbytes)
            )
            if not inserted:
                break
            at += 1
        self.promoted_blocks += at - start
        return at - start

    def write_through(self, keys: list[BlockHash], stop: int, written: list[tuple[int, int]]) -> None:
        """Hand the blocks just written to every write-through tier, in order: ``written`` holds
        (first, count) ranges of the stored chain ``keys[:stop]``."""
        targets = [tier for tier in self.tiers if tier.write_through]
        if not targets:
            return
        chain = self.store.snapshots(keys[:stop])
        blocks = [chain[index] for first, count in written for index in range(first, first + count)]
        for tier in targets:
            for block in blocks:
                tier.put(block)

    def remove_namespace(self, namespace: bytes) -> dict[str, int]:
        """Delete namespace ``namespace``'s entries from every tier: {tier name: entries removed}.
        Tier I/O: call it without holding the cache's lock."""
        return {tier.name: tier.remove_namespace(namespace) for tier in list(self.tiers)}

    def remove_keys(self, namespace: bytes, keys: list[bytes]) -> dict[str, int]:
        """Delete single entries from every tier that has ``remove_keys``: {tier name: removed}."""
        out: dict[str, int] = {}
        for tier in list(self.tiers):
            remove = getattr(tier, "remove_keys", None)
            if remove is not None:
                out[tier.name] = remove(namespace, keys)
        return out

    def _demote(self, event: str, block: Block) -> None:
        """The store's listener: a block evicted for capacity goes down to the write-back tiers."""
        if event == "evict" and block.evicted_reason == "capacity":
            for tier in self.tiers:
                if not tier.write_through:
                    tier.put(block)


def _constant_payload(payload: Any, nbytes: int) -> Callable[[int], tuple[Any, int]]:
    """A payload function for a one-block insert: that block's payload and size."""

    def fn(_index: int) -> tuple[Any, int]:
        return payload, nbytes

    return fn
