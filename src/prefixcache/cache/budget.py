"""BudgetedTree: a run tree under byte budgets. What enters is charged; what leaves goes here.

Only *leaves* (blocks with no cached child) are ever evicted or expired, so a chain is trimmed from
its tail and never orphaned in the middle, and an ancestor's freshness is the freshest of its
subtree: when a block's last child goes, the block inherits the child's last use (and so its
expiry, which is always ``last_used + ttl_s``). The evictable leaves wait in
:class:`~prefixcache.cache.leaves.LeafQueues` (LRU and per-TTL expiry order), so eviction and
expiry cost what they remove, not what is held.

* :meth:`BudgetedTree.insert_chain` charges new blocks, making room first (:meth:`make_room`:
  LRU leaves, block by block as one insert each would evict them).
* :meth:`BudgetedTree.sweep` removes the leaves whose TTL has passed; ``remove_where`` flushes.
* :meth:`BudgetedTree.drop` is the one way blocks leave: it uncharges them, cuts them from the
  tree, tells the listeners, and hands back a parent that became an evictable leaf.

It holds the :class:`~prefixcache.cache.runs.RunTree` and the
:class:`~prefixcache.cache.leaves.LeafQueues` it is given, and reaches them through their public
names; :class:`~prefixcache.cache.store.BlockStore` holds all three and adds references, TTL
classes and pins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixcache.cache.blocks import Block, Chain, Run
from prefixcache.cache.clock import Clock
from prefixcache.cache.keys import BlockHash
from prefixcache.cache.leaves import LeafQueues
from prefixcache.cache.runs import RunTree
from prefixcache.cache.shares import evict_own

#: ``fn(event, block)``; events: "insert", "evict" (``block.evicted_reason`` says why).
Listener = Callable[[str, Block], None]

#: ``fn(keys, namespace, reason, expires_at)``: blocks removed together (one run's last blocks,
#: in chain order), their namespace root, why ("ttl", "capacity", "flush") and when they were due.
RemovalListener = Callable[[list[BlockHash], bytes, str, float], None]

#: block index -> (payload, nbytes); called only for blocks actually stored.
PayloadFn = Callable[[int], tuple[Any, int]]


class BudgetedTree:
    """``tree`` under a byte budget, with a separate budget for pinned blocks (the store above
    moves bytes between the two, :meth:`to_pinned` and :meth:`from_pinned`); its evictable leaves
    wait in ``leaves``. Not thread-safe."""

    def __init__(
        self, tree: RunTree, leaves: LeafQueues, capacity_bytes: int, pinned_capacity_bytes: int, clock: Clock
    ) -> None:
        if capacity_bytes < 0 or pinned_capacity_bytes < 0:
            raise ValueError("capacity_bytes and pinned_capacity_bytes must be >= 0")
        self.tree = tree
        self.leaves = leaves
        self.capacity_bytes = int(capacity_bytes)
        self.pinned_capacity_bytes = int(pinned_capacity_bytes)
        self.clock = clock  # read on every use (a test may swap it: through the store)
        self._lru = leaves.lru  # (for membership tests on the hot path; only LeafQueues reorders it)
        self._listeners: list[Listener] = []
        self._removal_listeners: list[RemovalListener] = []
        self.bytes = 0  # unpinned blocks
        self.pinned_bytes = 0
        self.pinned_blocks = 0
        self.tenant_blocks: dict[str, int] = {}
        self.tenant_bytes: dict[str, int] = {}
        #: No run was ever stored with a shorter TTL class than this (TTLs only grow after).
        self.min_ttl_s = float("inf")
        #: Each tenant's share of ``capacity_bytes`` (see :mod:`~prefixcache.cache.shares`); None: one LRU.
        self.tenant_share: float | None = None

    def set_tenant_share(self, share: float | None) -> None:
        """Over ``share`` (0 < share <= 1) of the capacity, a tenant's inserts evict its own leaves first."""
        if share is not None and not 0.0 < share <= 1.0:
            raise ValueError(f"the tenant capacity share must be in (0, 1]; got {share}")
        if share is not None:
            self.leaves.track_tenants()
        self.tenant_share = share

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, block)`` on every insert and removal, under the caller's lock."""
        self._listeners.append(fn)

    def add_removal_listener(self, fn: RemovalListener) -> None:
        """Call ``fn`` once per removal of blocks (no snapshots: cheap enough for every
        eviction), under the caller's lock."""
        self._removal_listeners.append(fn)

    # ------------------------------------------------------------------ what enters
    def insert_chain(
        self,
        chain: Chain,
        first: int,
        stop: int,
        parent_run: Run | None,
        payload_fn: PayloadFn | None,
        *,
        uniform_nbytes: int | None = None,
        hold: bool = False,
    ) -> tuple[int, bool, Run | None]:
        """Insert new blocks ``first..stop-1`` of ``chain``: block ``j`` holds its tokens, TTL
        class and the payload ``payload_fn(j)`` (called only for blocks stored), each the child of
        the previous, the first a child of block ``first - 1``. Stops before a key that is already
        stored, or for lack of room.

        Returns (blocks inserted, whether it stopped for lack of room, the run holding the last
        one). Evictions happen block by block exactly as one insert each would make them; the
        chain's own blocks are never victims, nor is block ``first - 1``.

        ``parent_run``: the run whose tail is block ``first - 1`` (walked from ``keys`` when None
        or stale; a new branch off the middle of a run splits it). ``uniform_nbytes``: every
        payload has this size (the caller promises it), so room for the whole chain is made
        before the first insert (the same victims in the same order); with ``payload_fn`` None
        every payload is None and ``uniform_nbytes`` is required. ``hold``: the caller takes a
        reference on the last block at once, so it is not queued as a leaf, except when the
        chain stopped at a key already stored (the caller walks on first: it is queued meanwhile).
        """
        if payload_fn is None and uniform_nbytes is None:
            raise ValueError("insert_chain without payload_fn needs uniform_nbytes")
        keys = chain.keys
        if not first:
            parent_run = None
        elif parent_run is None or not parent_run.keys or parent_run.keys[-1] != keys[first - 1]:
            try:
                parent_run = self.tree.tail_at(keys, first - 1)
            except (KeyError, IndexError):
                return 0, True, None  # the parent is not stored
        depth = 0 if parent_run is None else parent_run.depth + len(parent_run.keys)
        if depth != first:
            raise ValueError(f"keys[{first}] follows a block at depth {depth - 1}: the chain is not rooted")
        return self.insert(chain, first, stop, parent_run, payload_fn, uniform_nbytes, hold, self.clock())

    def insert(
        self,
        chain: Chain,
        first: int,
        stop: int,
        parent_run: Run | None,
        payload_fn: PayloadFn | None,
        uniform_nbytes: int | None,
        hold: bool,
        now: float,
    ) -> tuple[int, bool, Run | None]:
        """:meth:`insert_chain` once ``parent_run`` is known to be the run whose tail is block
        ``first - 1`` (None at 0) and block ``first`` is not stored; ``now``: the insert's time."""
        keys, ttls, tenant = chain.keys, chain.ttls, chain.tenant
        cap = self.capacity_bytes
        payloads: list[Any] | None = None
        no_room = False
        at = first
        if uniform_nbytes is not None and uniform_nbytes <= cap:
            # None of them is stored: a block's key names its whole prefix, and block ``first``
            # is not stored, so no later one is either (barring a hash collision, which a walk's
            # token comparison catches later).
            total = (stop - first) * uniform_nbytes
            if self.bytes + total > cap:
                # If this fails, everything evictable is gone and the block-by-block insert below
                # stops where it would have.
                self.make_room(total, parent_run, tenant)
            if payload_fn is None and self.bytes + total <= cap:
                # Room for all of them: no eviction can happen between them, so they go in at once.
                if first == stop:
                    return 0, False, None
                self._attach(parent_run)
                self.bytes += total
                sizes = [uniform_nbytes] * (stop - first)
                unit = uniform_nbytes
                at = stop
        if at == first:  # block by block: each block may need room, made before it goes in
            payloads, sizes, at, no_room = self._take_blocks(
                keys, first, stop, parent_run, payload_fn, uniform_nbytes, tenant
            )
            if at == first:
                return 0, no_room, None
            total = sum(sizes)
            unit = sizes[0] if sizes.count(sizes[0]) == at - first else 0  # 0: sizes differ
        if ttls[at - 1] < self.min_ttl_s:  # (the chain's shortest TTL is its last: TTLs fall along it)
            self.min_ttl_s = float(ttls[at - 1])
        last = self.tree.add_runs(chain, first, at, parent_run, payloads, sizes, unit, now)
        if self._listeners:
            for run, _, _ in self.tree.chain(keys, first, at):
                for offset in range(len(run.keys)):
                    for fn in self._listeners:
                        fn("insert", run.block(offset))
        tenant_blocks = self.tenant_blocks
        tenant_blocks[tenant] = tenant_blocks.get(tenant, 0) + at - first
        tenant_bytes = self.tenant_bytes
        tenant_bytes[tenant] = tenant_bytes.get(tenant, 0) + total
        if not hold or (not no_room and at < stop):
            self.leaves.enter(last)
        return at - first, no_room, last

    def _take_blocks(
        self,
        keys: list[BlockHash],
        first: int,
        stop: int,
        parent_run: Run | None,
        payload_fn: PayloadFn | None,
        uniform_nbytes: int | None,
        tenant: str,
    ) -> tuple[list[Any], list[int], int, bool]:
        """The block-by-block part of ``tenant``'s insert: make room for and charge each block
        from ``first`` in turn, stopping before a stored key or for lack of room. Returns
        (payloads, sizes, the block it stopped at, whether for lack of room). Until the chain is
        complete its blocks are in no queue, so they cannot be victims."""
        index = self.tree.index
        cap = self.capacity_bytes
        payloads: list[Any] = []
        sizes: list[int] = []
        at = first
        while at < stop and keys[at] not in index:
            payload, nbytes = payload_fn(at) if payload_fn is not None else (None, uniform_nbytes)
            nbytes = int(nbytes)  # type: ignore[arg-type]
            if nbytes > cap or (
                self.bytes + nbytes > cap
                and not self.make_room(nbytes, parent_run if at == first else None, tenant)
            ):
                self.tree.counters.rejected += 1
                return payloads, sizes, at, True
            if at == first:
                self._attach(parent_run)  # now: later blocks' evictions must not take the parent
            payloads.append(payload)
            sizes.append(nbytes)
            self.bytes += nbytes
            at += 1
        return payloads, sizes, at, False

    def _attach(self, parent_run: Run | None) -> None:
        """``parent_run``'s tail gets a child: it is no longer a leaf."""
        if parent_run is not None:
            if parent_run.n_children == 0 and parent_run in self._lru:
                self.leaves.leave(parent_run)
            parent_run.n_children += 1

    # ------------------------------------------------------------------ what leaves
    def sweep(self) -> int:
        """Remove every unreferenced, unpinned block whose TTL has passed. Returns blocks removed.
        O(expired + TTL classes)."""
        now = self.clock()
        leaves = self.leaves
        if now < leaves.earliest:  # nothing is due (every request sweeps: this is the usual case)
            return 0
        leaves.earliest = float("inf")  # (every class's last pop_due sets it again; so does enter)
        removed = 0
        # Removing a leaf can make its parent a due leaf (in this class or a longer one), so
        # repeat until a pass removes nothing.
        progress = True
        while progress:
            progress = False
            for ttl in leaves.classes:  # (a class added meanwhile is swept by the next pass)
                while (popped := leaves.pop_due(ttl, now)) is not None:
                    run, after = popped
                    progress = True
                    # Block by block, the tail's parent would be a due leaf of this class with the
                    # same expiry; the whole run goes at once when it is at least as early as the
                    # next leaf of the class (else one block, and the rest is queued at the back).
                    due = run.last_used + run.ttl_s
                    count = len(run.keys) if after is None or due <= after.last_used + after.ttl_s else 1
                    removed += count
                    orphan = self.drop(run, count, "ttl", requeue=False)
                    if run.keys:  # part of the run is left: its new tail is queued
                        leaves.enter(run, ordered=True)
                        continue
                    # The parent run, now a leaf with the same last use, goes too while it is due
                    # and no other leaf of its class expires before it.
                    while (
                        orphan is not None
                        and orphan.ttl_s == ttl
                        and orphan.last_used + orphan.ttl_s <= now
                        and leaves.none_before(ttl, orphan.last_used + orphan.ttl_s)
                    ):
                        removed += len(orphan.keys)
                        orphan = self.drop(orphan, len(orphan.keys), "ttl", requeue=False)
                    if orphan is not None:
                        leaves.enter(orphan, ordered=True)
        return removed

    def remove_where(self, pred: Callable[[Run], bool], reason: str = "flush") -> int:
        """Remove every unreferenced, unpinned block of the runs for which ``pred`` holds
        (``pred`` sees a run's ``namespace`` and ``tenant``), leaves first. Returns blocks removed."""
        victims = sorted(
            (run for run in self.tree.runs() if run.pin_count == 0 and pred(run)),
            key=lambda run: -(run.depth + len(run.keys)),
        )
        return self.remove_runs(victims, reason)

    def remove_runs(self, victims: list[Run], reason: str) -> int:
        """Remove, in order, each of ``victims`` that is (still) a live, unreferenced, unpinned
        leaf run. Returns blocks removed."""
        removed = 0
        for run in victims:
            if run.n_children == 0 and run.ref_count == 0 and run.pin_count == 0 and run.keys:
                if run in self._lru:
                    self.leaves.leave(run)
                removed += len(run.keys)
                self.drop(run, len(run.keys), reason, requeue=True)
        return removed

    def make_room(self, nbytes: int, protect: Run | None = None, tenant: str | None = None) -> bool:
        """Evict LRU leaves until ``nbytes`` more fit; False when nothing (but ``protect``) is left
        to evict. The victims, their order and where the rest is queued are those of evicting
        one leaf block at a time; a run's blocks go in one step where that changes nothing.
        ``protect``: the parent of a block being inserted, which must survive its child's insert.
        ``tenant``: the tenant inserting, whose own leaves go first while it is over its share
        (None: room comes from the LRU alone, as for bytes that are the tenant's already)."""
        cap = self.capacity_bytes
        leaves = self.leaves
        if self.tenant_share is not None and tenant is not None:
            evict_own(self, tenant, nbytes, protect)
        while self.bytes + nbytes > cap:
            picked = leaves.victim(protect)
            if picked is None:
                return False
            # ``front``: the first queued run other than the victim, before anything moves.
            victim, front, lead = picked
            queued = True
            while True:
                # Block by block, each parent left inside the run is the next victim when it is
                # at least as old as the front (it inherits the tail's time); else it is queued.
                length = len(victim.keys)
                if front is not None and victim.last_used > front.last_used:
                    count = 1
                elif victim.unit:  # (the usual case, inlined: blocks of one size)
                    count = -(-(self.bytes + nbytes - cap) // victim.unit)
                    if count > length:
                        count = length
                else:
                    count = self.blocks_to_free(victim, self.bytes + nbytes - cap)
                if count < length:  # part of the run is left: its new tail is queued as a leaf entering
                    self.drop(victim, count, "capacity", requeue=False)  # (touches no queue)
                    if queued:
                        leaves.requeue_trimmed(victim, front, lead)
                    else:
                        leaves.enter(victim, ordered=True)
                    break
                if queued:
                    leaves.leave(victim)
                orphan = self.drop(victim, count, "capacity", requeue=False)
                # The run is gone; its parent, if now an evictable leaf, is the next victim while
                # room is needed and it is at least as old as the front.
                if orphan is None:
                    break
                front = leaves.first()  # (the orphan is in no queue: this is the first other run)
                if (
                    self.bytes + nbytes > cap
                    and orphan is not protect
                    and (front is None or orphan.last_used <= front.last_used)
                ):
                    victim, queued = orphan, False
                    continue
                leaves.enter(orphan, ordered=True)
                break
        return True

    @staticmethod
    def blocks_to_free(run: Run, need: int) -> int:
        """How many of ``run``'s last blocks free at least ``need`` bytes (all of them at most)."""
        length = len(run.keys)
        count, freed, sizes = 0, 0, run.sizes
        while freed < need and count < length:
            count += 1
            freed += sizes[-count]
        return count

    def drop(self, run: Run, count: int, reason: str, *, requeue: bool) -> Run | None:
        """Remove the last ``count`` blocks of an unqueued, unpinned ``run`` (tail first), telling
        the listeners. When the run empties, its parent's tail, now possibly a leaf, inherits its
        freshness; an evictable leaf parent is queued (``requeue``) or returned for the caller to
        queue or remove. Else None."""
        keep = len(run.keys) - count
        snapshots = None
        if self._listeners:
            snapshots = [run.block(offset, reason) for offset in range(keep + count - 1, keep - 1, -1)]
        if self._removal_listeners:
            dropped, due = run.keys[keep:], run.last_used + run.ttl_s
            for removed in self._removal_listeners:
                removed(dropped, run.namespace, reason, due)
        freed = run.unit * count if run.unit else sum(run.sizes[keep:])
        self.bytes -= freed
        self.tenant_blocks[run.tenant] -= count
        self.tenant_bytes[run.tenant] -= freed
        evictions = self.tree.counters.evictions
        evictions[reason] = evictions.get(reason, 0) + count
        parent = self.tree.cut(run, count, freed)
        if snapshots is not None:
            for block in snapshots:
                for fn in self._listeners:
                    fn("evict", block)
                block.payload = None  # drop the tensor now; listeners have had it
        if parent is None or parent.n_children or parent.ref_count or parent.pin_count:
            return None  # (no parent, or not an evictable leaf)
        if requeue:
            self.leaves.enter(parent, ordered=True)
            return None
        return parent

    # ------------------------------------------------------------------ the pinned budget
    def to_pinned(self, run: Run) -> None:
        """Move ``run``'s bytes from the main budget to the pinned one (the caller checked the
        pinned budget's room and unqueued the run)."""
        self.bytes -= run.nbytes
        self.pinned_bytes += run.nbytes
        self.pinned_blocks += len(run.keys)

    def from_pinned(self, run: Run) -> None:
        """Move ``run``'s bytes back from the pinned budget to the main one (the caller made room)."""
        self.pinned_bytes -= run.nbytes
        self.pinned_blocks -= len(run.keys)
        self.bytes += run.nbytes

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the tree's invariants, the byte and tenant accounting and the leaf queues. O(n)."""
        self.tree.check()
        held_bytes, pinned_bytes, pinned = 0, 0, 0
        tenant_blocks: dict[str, int] = {}
        tenant_bytes: dict[str, int] = {}
        is_leaf: dict[Run, bool] = {}
        for run in self.tree.runs():
            if run.pin_count:
                pinned_bytes += run.nbytes
                pinned += len(run.keys)
            else:
                held_bytes += run.nbytes
            tenant_blocks[run.tenant] = tenant_blocks.get(run.tenant, 0) + len(run.keys)
            tenant_bytes[run.tenant] = tenant_bytes.get(run.tenant, 0) + run.nbytes
            is_leaf[run] = run.ref_count == 0 and run.pin_count == 0 and run.n_children == 0
        self.leaves.check(is_leaf)
        assert held_bytes == self.bytes, f"byte count drifted: {self.bytes} recorded, {held_bytes} held"
        assert pinned_bytes == self.pinned_bytes and pinned == self.pinned_blocks, "pinned count drifted"
        assert self.bytes <= self.capacity_bytes, "over the byte budget"
        assert self.pinned_bytes <= self.pinned_capacity_bytes, "over the pinned budget"
        assert {t: n for t, n in self.tenant_blocks.items() if n} == tenant_blocks, "tenant blocks drifted"
        assert {t: n for t, n in self.tenant_bytes.items() if n} == {
            t: n for t, n in tenant_bytes.items() if n
        }, "tenant bytes drifted"
