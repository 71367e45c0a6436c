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
    """What :func:`evict_own` uses of the budgeted tree (:class:`~prefixcache.cache.budget.BudgetedTree`)."""

    tenant_share: float | None
    capacity_bytes: int
    bytes: int
    tenant_bytes: dict[str, int]
    _leaves: LeafQueues

    def _blocks_to_free(self, run: Run, need: int) -> int: ...
    def _drop(self, run: Run, count: int, reason: str, *, requeue: bool) -> Run | None: ...


def evict_own(tree: ShareHolder, tenant: str, nbytes: int, protect: Run | None) -> None:
    """Make room for ``nbytes`` of ``tenant`` out of its own leaves while it is over its share
    (``tree.tenant_share``) and room is needed; stops when neither holds or it has
    no evictable leaf left (``protect``, the parent of the block going in, stays)."""
    share = tree.tenant_share
    if share is None:
        return
    cap = tree.capacity_bytes
    share_bytes = int(share * cap)
    leaves = tree._leaves
    tenant_bytes = tree.tenant_bytes
    while tree.bytes + nbytes > cap:
        over = tenant_bytes.get(tenant, 0) + nbytes - share_bytes
        if over <= 0:
            return
        victim = leaves.tenant_first(tenant, protect)
        if victim is None:
            return
        need = min(tree.bytes + nbytes - cap, over)
        count = tree._blocks_to_free(victim, need)
        leaves.leave(victim)
        if count < len(victim.keys):
            tree._drop(victim, count, "capacity", requeue=False)
            leaves.enter(victim, ordered=True)  # its new tail is as old as the run was
        else:
            tree._drop(victim, count, "capacity", requeue=True)  # an orphaned leaf parent is queued
