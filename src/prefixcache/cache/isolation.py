"""What keeps one tenant from slowing the others through the cache's one lock.

* :func:`prefetch`: the tier reads of a request (disk, Redis) outside the lock, on the request's
  own thread before admission; the lock is held only to find where memory's walk ends and to
  insert what the tiers returned, verified by them exactly as a promotion inside ``match`` is.
* :func:`remove_in_slices`: a flush removes its runs a slice at a time (``SLICE_RUNS`` runs per
  hold of the lock), so other requests' matches and commits interleave with a large flush.

Both are called by :class:`~prefixcache.cache.manager.PrefixCache` and reach the store and the
tiers through their public methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prefixcache.cache.blocks import Run
from prefixcache.cache.keys import BlockHash, Namespace
from prefixcache.cache.policy import TtlPlan

if TYPE_CHECKING:
    from prefixcache.cache.manager import PrefixCache

#: Runs a flush looks at per hold of the cache's lock.
SLICE_RUNS = 256
#: Passes of a flush over the store's runs: a run split by an insert during a pass is new to it,
#: so a pass that removed something is followed by another (each sees fewer runs).
MAX_PASSES = 4


def prefetch(
    cache: PrefixCache,
    tokens: Sequence[int] | None,
    ns: Namespace,
    *,
    align_tokens: int | None = None,
    ttl_s: float | None = None,
    ttl_plan: TtlPlan | None = None,
    keys: list[BlockHash] | None = None,
    packed: bytes | None = None,
) -> int:
    """Bring the blocks of this prompt that memory lacks and the tiers hold into memory, reading
    the tiers without holding the cache's lock. Returns blocks inserted. A later :meth:`match`
    finds them as if computed (unless evicted meanwhile: then it misses, never serves wrong)."""
    stack = cache._tier_stack
    if not stack.tiers:
        return 0
    align, keys, packed, ttls = cache._prepare(tokens, ns, align_tokens, ttl_s, ttl_plan, keys, packed)
    block_size = cache.block_size
    step = 4 * block_size
    max_blocks = (max((len(packed) >> 2) - 1, 0) // align) * align // block_size
    with cache._lock:
        cache.store.sweep()  # (as match does first: an expired block is not memory's)
        found, _ = cache.store.lookup(keys, packed, max_blocks)
    if found >= max_blocks:
        return 0
    got, unavailable = stack.read(keys, packed, step, found, max_blocks, ns.root)  # (no lock: I/O)
    with cache._lock:
        stack.unavailable = unavailable
        if not got:
            return 0
        # Memory may have moved meanwhile: continue from where its walk ends now, when that is
        # inside what was read (block ``now - 1`` stored); else the chain is broken, insert nothing.
        now, _ = cache.store.lookup(keys, packed, max_blocks)
        if not found <= now < found + len(got):
            return 0
        return stack.insert(
            keys, packed, step, now, got[now - found :], ns.root, ns.tenant, ttls, cache.adopt
        )


def remove_in_slices(cache: PrefixCache, pred: Callable[[Run], bool], reason: str) -> int:
    """Remove every unreferenced, unpinned block of the runs for which ``pred`` holds, as
    :meth:`~prefixcache.cache.budget.BudgetedTree.remove_where` does (deepest runs first, so a
    parent follows its children), but at most ``SLICE_RUNS`` runs per hold of the lock. Blocks
    written while it runs may stay. Returns blocks removed."""
    store = cache.store
    removed = 0
    for _ in range(MAX_PASSES):
        with cache._lock:
            runs = store.runs()  # (a list copy of the live runs: no test, no sort under the lock)
        # A run's namespace and tenant never change: ``pred`` may read them without the lock.
        victims = [run for run in runs if run.keys and pred(run)]
        victims.sort(key=lambda run: -(run.depth + len(run.keys)))
        this_pass = 0
        for first in range(0, len(victims), SLICE_RUNS):
            with cache._lock:
                this_pass += store.remove_runs(victims[first : first + SLICE_RUNS], reason)
        removed += this_pass
        if not this_pass:
            break
    return removed
