"""PinnedPrefixes: keep-warm bookkeeping. Which prefixes are pinned, and pinning them in the store.

A pinned prefix is a chain of blocks, each a run of its own (``BlockStore.isolate``), pinned
root-first and unpinned tail-first; pinned blocks neither expire nor are evicted, and they are
charged to the store's pinned budget. :class:`~prefixcache.cache.manager.PrefixCache` owns one
and calls it under its lock; it reaches the store through its public methods only.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.cache.blocks import Run
from prefixcache.cache.keys import BlockHash
from prefixcache.cache.store import BlockStore


class PinnedPrefixes:
    """The prefixes pinned in ``store``, by (namespace root, key of the prefix's last block)."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self._chains: dict[tuple[bytes, BlockHash], list[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def pin(self, keys: list[BlockHash], packed: bytes, root: bytes) -> int:
        """Pin the stored, live leading blocks of the prompt ``keys`` (``packed``: its tokens) in
        namespace ``root``. Returns how many (0: none stored). Pinning an already pinned prefix
        changes nothing. Raises :class:`~prefixcache.cache.store.PinBudgetExceeded`, pinning
        nothing."""
        store = self.store
        found, _ = store.lookup(keys, packed, len(keys))
        if not found:
            return 0
        pin_id = (root, keys[found - 1])
        if pin_id in self._chains:
            return found
        runs = [store.isolate(keys, index) for index in range(found)]  # a pinned block is a run of its own
        done: list[Run] = []
        try:
            for run in runs:
                store.pin(run)
                done.append(run)
        except BaseException:
            for run in reversed(done):  # all or nothing
                store.unpin(run)
            raise
        self._chains[pin_id] = keys[:found]
        return found

    def unpin(self, keys: Iterable[BlockHash], root: bytes) -> int:
        """Unpin every prefix of namespace ``root`` that ends at one of ``keys``. Returns the
        blocks of the longest (0: none was pinned). Raises
        :class:`~prefixcache.cache.store.CacheFullError` when a block cannot return to a full
        budget; that prefix is forgotten all the same, its blocks from that one up still pinned
        (the behaviour the reference model pins down)."""
        ends = set(keys)
        unpinned = 0
        for pin_id in [pin_id for pin_id in self._chains if pin_id[0] == root and pin_id[1] in ends]:
            chain = self._chains.pop(pin_id)
            for key in reversed(chain):
                run = self.store.run_of(key)
                if run is not None:
                    self.store.unpin(run)
            unpinned = max(unpinned, len(chain))
        return unpinned

    def check(self) -> None:
        """Assert that every block of every pinned prefix is still stored and pinned."""
        for chain in self._chains.values():
            for key in chain:
                run = self.store.run_of(key)
                assert run is not None and run.pin_count > 0, "a pinned prefix lost a block"
