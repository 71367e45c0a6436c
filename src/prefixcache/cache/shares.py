"""Each tenant's share of the cache's capacity: over it, a tenant pays for its inserts with its
own leaves.

Eviction is one LRU over every tenant's leaves (:mod:`~prefixcache.cache.budget`). With a share
``F`` set (:meth:`~prefixcache.cache.budget.BudgetedTree.set_tenant_share`), room for a block that
tenant T inserts is first made from T's own least recently used leaves while T holds more than
``F x capacity`` with the block; the global LRU is used only for what is still missing. So a
tenant flooding the cache over its share evicts its own blocks, not the others' warm prefixes.
While there is free room nothing is evicted: a tenant may use idle capacity beyond its share.

The leaves of each tenant are kept in their own queue (:meth:`LeafQueues.track_tenants`), so
finding a victim is O(1) and the cost of evicting stays proportional to what is removed.
"""

from __future__ import annotations

from typing import Protocol

from prefixcache.cache.blocks import Run
from prefixcache.cache.leaves import LeafQueues


class ShareHolder(Protocol):
    """What :func:`evict_own` uses of the budget (:class:`~prefixcache.cache.budget.BudgetedTree`):
    its public names only."""

    tenant_share: float | None
    capacity_bytes: int
    bytes: int
    tenant_bytes: dict[str, int]
    leaves: LeafQueues

    def blocks_to_free(self, run: Run, need: int) -> int: ...
    def drop(self, run: Run, count: int, reason: str, *, requeue: bool) -> Run | None: ...


def evict_own(budget: ShareHolder, tenant: str, nbytes: int, protect: Run | None) -> None:
    """Make room for ``nbytes`` of ``tenant`` out of its own leaves while it is over its share
    (``budget.tenant_share``) and room is needed; stops when neither holds or it has
    no evictable leaf left (``protect``, the parent of the block going in, stays)."""
    share = budget.tenant_share
    if share is None:
        return
    cap = budget.capacity_bytes
    share_bytes = int(share * cap)
    leaves = budget.leaves
    tenant_bytes = budget.tenant_bytes
    while budget.bytes + nbytes > cap:
        over = tenant_bytes.get(tenant, 0) + nbytes - share_bytes
        if over <= 0:
            return
        victim = leaves.tenant_first(tenant, protect)
        if victim is None:
            return
        need = min(budget.bytes + nbytes - cap, over)
        count = budget.blocks_to_free(victim, need)
        leaves.leave(victim)
        if count < len(victim.keys):
            budget.drop(victim, count, "capacity", requeue=False)
            leaves.enter(victim, ordered=True)  # its new tail is as old as the run was
        else:
            budget.drop(victim, count, "capacity", requeue=True)  # an orphaned leaf parent is queued
