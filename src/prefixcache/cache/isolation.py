"""What keeps one tenant from slowing the others through the cache's one lock.

* :func:`prefetch`: the tier reads of a request (disk, Redis) outside the lock, on the request's
  own thread before admission; the lock is held only to find where memory's walk ends and to
  insert what the tiers returned, verified by them exactly as a promotion inside ``match`` is.
* :func:`remove_in_slices`: a flush removes its runs a slice at a time (``SLICE_RUNS`` runs per
  hold of the lock), so other requests' matches and commits interleave with a large flush.

Both are called by :class:`~prefixcache.cache.manager.PrefixCache` with its parts (its lock, its
store, its tier stack) and reach them through their public methods, never the cache itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prefixcache.cache.blocks import Chain, Run
from prefixcache.cache.store import BlockStore
from prefixcache.cache.tiers.stack import TierStack

#: Runs a flush looks at per hold of the cache's lock.
SLICE_RUNS = 256
#: Passes of a flush over the store's runs: a run split by an insert during a pass is new to it,
#: so a pass that removed something is followed by another (each sees fewer runs).
MAX_PASSES = 4


def prefetch(
    lock: threading.RLock,
    store: BlockStore,
    stack: TierStack,
    chain: Chain,
    *,
    align: int,
    adopt: Callable[[Any], Any] | None,
) -> int:
    """Bring the blocks of this prompt (its ``chain``, prepared as ``match`` prepares it; a hit
    ends on a multiple of ``align`` tokens) that memory lacks and the tiers hold into memory,
    reading the tiers without holding ``lock``. Returns blocks inserted. A later ``match`` finds
    them as if computed (unless evicted meanwhile: then it misses, never serves wrong)."""
    if not stack.tiers:
        return 0
    keys, packed, block_size = chain.keys, chain.packed, chain.step >> 2
    max_blocks = (max((len(packed) >> 2) - 1, 0) // align) * align // block_size
    with lock:
        store.sweep()  # (as match does first: an expired block is not memory's)
        found, _ = store.lookup(keys, packed, max_blocks)
    if found >= max_blocks:
        return 0
    got, unavailable = stack.read(chain, found, max_blocks)  # (no lock: I/O)
    with lock:
        stack.unavailable = unavailable
        if not got:
            return 0
        # Memory may have moved meanwhile: continue from where its walk ends now, when that is
        # inside what was read (block ``now - 1`` stored); else the chain is broken, insert nothing.
        now, _ = store.lookup(keys, packed, max_blocks)
        if not found <= now < found + len(got):
            return 0
        return stack.insert(chain, now, got[now - found :], adopt)


def remove_in_slices(
    lock: threading.RLock, store: BlockStore, pred: Callable[[Run], bool], reason: str
) -> int:
    """Remove every unreferenced, unpinned block of the runs for which ``pred`` holds, as
    :meth:`~prefixcache.cache.budget.BudgetedTree.remove_where` does (deepest runs first, so a
    parent follows its children), but at most ``SLICE_RUNS`` runs per hold of the lock. Blocks
    written while it runs may stay. Returns blocks removed."""
    removed = 0
    for _ in range(MAX_PASSES):
        with lock:
            runs = store.runs()  # (a list copy of the live runs: no test, no sort under the lock)
        # A run's namespace and tenant never change: ``pred`` may read them without the lock.
        victims = [run for run in runs if run.keys and pred(run)]
        victims.sort(key=lambda run: -(run.depth + len(run.keys)))
        this_pass = 0
        for first in range(0, len(victims), SLICE_RUNS):
            with lock:
                this_pass += store.remove_runs(victims[first : first + SLICE_RUNS], reason)
        removed += this_pass
        if not this_pass:
            break
    return removed
