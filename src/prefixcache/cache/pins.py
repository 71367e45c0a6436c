"""PinnedPrefixes: keep-warm bookkeeping. Which prefixes are pinned, and pinning them in the store.

A pinned prefix is a chain of blocks, each a run of its own (``BlockStore.isolate``), pinned
root-first and unpinned tail-first; pinned blocks neither expire nor are evicted, and they are
charged to the store's pinned budget. With a ``tenant_share`` below 1, one tenant's pinned
blocks may take at most that share of the budget (:class:`TenantPinBudgetExceeded` beyond), so
one tenant cannot keep every other from pinning. :class:`~prefixcache.cache.manager.PrefixCache`
owns one and calls it under its lock; it reaches the store through its public methods only.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.cache.blocks import Run
from prefixcache.cache.keys import BlockHash
from prefixcache.cache.store import BlockStore, PinBudgetExceeded


class TenantPinBudgetExceeded(PinBudgetExceeded):
    """Pinning would take the tenant past its share of the pinned budget."""

    def __init__(self, tenant: str, needed: int, used: int, limit: int, share: float) -> None:
        self.tenant, self.needed, self.used, self.limit, self.share = tenant, needed, used, limit, share
        super().__init__(
            f"tenant {tenant!r} has {used} of its {limit} pinned bytes ({share:g} of the pinned budget) "
            f"in use and this prefix needs {needed} more"
        )


class PinnedPrefixes:
    """The prefixes pinned in ``store``, by (namespace root, key of the prefix's last block).
    ``tenant_share``: the part of the pinned budget one tenant may hold (1.0: all of it)."""

    def __init__(self, store: BlockStore, tenant_share: float = 1.0) -> None:
        self.store = store
        self.tenant_share = tenant_share
        self._chains: dict[tuple[bytes, BlockHash], list[BlockHash]] = {}
        self._tenant_bytes: dict[str, int] = {}  # pinned bytes per tenant (blocks pinned once or more)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s pinned blocks."""
        return self._tenant_bytes.get(tenant, 0)

    def tenant_limit(self) -> int:
        """The most pinned bytes one tenant may hold."""
        return int(self.tenant_share * self.store.pinned_capacity_bytes)

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
        new = [run for run in runs if run.pin_count == 0]  # what this pin adds to the tenant's bytes
        tenant = runs[0].tenant
        needed = sum(run.nbytes for run in new)
        used = self.tenant_bytes(tenant)
        if self.tenant_share < 1.0 and used + needed > self.tenant_limit():
            raise TenantPinBudgetExceeded(tenant, needed, used, self.tenant_limit(), self.tenant_share)
        done: list[Run] = []
        try:
            for run in runs:
                store.pin(run)
                done.append(run)
        except BaseException:
            for run in reversed(done):  # all or nothing
                store.unpin(run)
            raise
        self._tenant_bytes[tenant] = used + needed
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
                    last, tenant, size = run.pin_count == 1, run.tenant, run.nbytes
                    self.store.unpin(run)
                    if last:  # its bytes leave the tenant's share
                        self._tenant_bytes[tenant] -= size
            unpinned = max(unpinned, len(chain))
        return unpinned

    def check(self) -> None:
        """Assert that every block of every pinned prefix is still stored and pinned."""
        for chain in self._chains.values():
            for key in chain:
                run = self.store.run_of(key)
                assert run is not None and run.pin_count > 0, "a pinned prefix lost a block"
        by_tenant: dict[str, int] = {}
        for block in self.store:
            if block.pin_count > 0:
                by_tenant[block.tenant] = by_tenant.get(block.tenant, 0) + block.nbytes
        held = {tenant: size for tenant, size in self._tenant_bytes.items() if size}
        assert held == by_tenant, f"pinned bytes per tenant {held} != {by_tenant}"
