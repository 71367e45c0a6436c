"""BlockStore: cached blocks under a byte budget, with references, TTL classes and pins.

The store knows blocks, never requests. A request holds one reference, on the deepest block of
its prefix: every ancestor has a child, so none of them can be evicted or expired while the
request runs (only leaves go; see :mod:`~prefixcache.cache.budget`). A hit refreshes only that
deepest block: an ancestor's freshness is the freshest of its subtree. So every per-request
operation is O(1) in the prefix length, except where a longer TTL class is asked for.

The store is composed of parts, each knowing nothing of the ones above it and reached through
its public names:

* :class:`~prefixcache.cache.runs.RunTree`: blocks kept as runs, indexed, walked, split;
* :class:`~prefixcache.cache.leaves.LeafQueues`: the order in which evictable leaves go;
* :class:`~prefixcache.cache.budget.BudgetedTree`, over the two: byte budgets, inserts,
  eviction, expiry;
* here, :class:`BlockStore`, holding all three: lookups, chain writes and holds, references, TTL
  classes, pins, and :meth:`BlockStore.check_integrity`.

Callers see :class:`Block` snapshots (``get``, iteration, listener events). The mutating methods
are for :class:`~prefixcache.cache.manager.PrefixCache`, which holds a lock and reaches the store
through its public methods only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prefixcache.cache.blocks import Block, Chain, Run, Segment, StoreCounters
from prefixcache.cache.budget import BudgetedTree, Listener, PayloadFn, RemovalListener
from prefixcache.cache.clock import Clock, monotonic
from prefixcache.cache.config import DEFAULTS
from prefixcache.cache.keys import BlockHash
from prefixcache.cache.leaves import LeafQueues
from prefixcache.cache.runs import RunTree

__all__ = [
    "Block",
    "BlockStore",
    "Chain",
    "CacheFullError",
    "Listener",
    "PayloadFn",
    "PinBudgetExceeded",
    "Run",
    "Segment",
    "StoreCounters",
]


class PinBudgetExceeded(RuntimeError):
    """Pinning would exceed the pinned-bytes budget."""


class CacheFullError(RuntimeError):
    """An operation needs room that only blocks in use could give."""


class BlockStore:
    """Blocks under a byte budget, a TTL per block, and a separate budget for pinned blocks.

    Not thread-safe by itself: :class:`~prefixcache.cache.manager.PrefixCache` holds a lock.
    """

    def __init__(
        self,
        capacity_bytes: int = DEFAULTS.capacity_bytes,
        pinned_capacity_bytes: int = DEFAULTS.pinned_capacity_bytes,
        clock: Clock = monotonic,
    ) -> None:
        self._tree = RunTree()
        self._leaves = LeafQueues()
        self._budget = BudgetedTree(self._tree, self._leaves, capacity_bytes, pinned_capacity_bytes, clock)
        self._clock = clock
        # The queues themselves, for membership tests on the hot path; only LeafQueues reorders them.
        self._lru = self._leaves.lru
        self._expiry = self._leaves.expiry

    # ------------------------------------------------------------------ what is held
    @property
    def clock(self) -> Clock:
        """The store's clock, read on every use (a test may swap it)."""
        return self._clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._clock = self._budget.clock = clock

    @property
    def counters(self) -> StoreCounters:
        return self._tree.counters

    @property
    def pinned_bytes(self) -> int:
        return self._budget.pinned_bytes

    @property
    def pinned_blocks(self) -> int:
        return self._budget.pinned_blocks

    @property
    def capacity_bytes(self) -> int:
        return self._budget.capacity_bytes

    @property
    def pinned_capacity_bytes(self) -> int:
        return self._budget.pinned_capacity_bytes

    @property
    def tenant_blocks(self) -> dict[str, int]:
        return self._budget.tenant_blocks

    @property
    def tenant_bytes(self) -> dict[str, int]:
        return self._budget.tenant_bytes

    def __len__(self) -> int:
        return len(self._tree)

    def __contains__(self, key: object) -> bool:
        return key in self._tree

    def __iter__(self) -> Iterator[Block]:
        """Snapshots of every block (O(n): for tests, admin and debugging)."""
        return iter(self._tree)

    def runs(self) -> list[Run]:
        """Every live run (a list copy)."""
        return self._tree.runs()

    def get(self, key: BlockHash) -> Block | None:
        """A snapshot of the block stored under ``key``, or None."""
        return self._tree.get(key)

    def run_of(self, key: BlockHash) -> Run | None:
        """The run holding ``key`` (O(1) for a run's first block, else a scan: admin and tests)."""
        return self._tree.run_of(key)

    def isolate(self, keys: list[BlockHash], at: int) -> Run:
        """Block ``at`` of the stored chain ``keys`` as a run of its own (to pin it)."""
        return self._tree.isolate(keys, at)

    # ------------------------------------------------------------------ the budget's operations
    def sweep(self) -> int:
        """Remove every unreferenced, unpinned block whose TTL has passed. Returns blocks removed."""
        return self._budget.sweep()

    def remove_where(self, pred: Callable[[Run], bool], reason: str = "flush") -> int:
        """Remove every unreferenced, unpinned block of the runs for which ``pred`` holds, leaves
        first (:meth:`~prefixcache.cache.budget.BudgetedTree.remove_where`). Returns blocks removed."""
        return self._budget.remove_where(pred, reason)

    def remove_runs(self, victims: list[Run], reason: str) -> int:
        """Remove, in order, each of ``victims`` that is (still) a live, unreferenced, unpinned
        leaf run. Returns blocks removed."""
        return self._budget.remove_runs(victims, reason)

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
        """Insert new blocks ``first..stop-1`` of ``chain`` (see
        :meth:`~prefixcache.cache.budget.BudgetedTree.insert_chain`)."""
        return self._budget.insert_chain(
            chain, first, stop, parent_run, payload_fn, uniform_nbytes=uniform_nbytes, hold=hold
        )

    def set_tenant_share(self, share: float | None) -> None:
        """Over ``share`` (0 < share <= 1) of the capacity, a tenant's inserts evict its own leaves first."""
        self._budget.set_tenant_share(share)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, block)`` on every insert and removal, under the caller's lock."""
        self._budget.add_listener(fn)

    def add_removal_listener(self, fn: RemovalListener) -> None:
        """Call ``fn`` once per removal of blocks (no snapshots), under the caller's lock."""
        self._budget.add_removal_listener(fn)

    # ------------------------------------------------------------------ requests' chains
    def lookup(self, keys: list[BlockHash], packed: bytes, stop: int) -> tuple[int, list[Segment]]:
        """How many leading ``keys[:stop]`` a request finds now: the tree's
        :meth:`~prefixcache.cache.runs.RunTree.walk`, less a deepest block that is due but not
        swept yet. Touches nothing. The segments are the walk's."""
        count, segments = self._tree.walk(keys, packed, stop)
        if count:
            # Only a leaf can be due (ancestors' freshness is their subtree's), so one check.
            run = segments[-1][0]
            is_leaf = count - run.depth == len(run.keys) and run in self._lru
            if is_leaf and run.last_used + run.ttl_s <= self._clock():
                count -= 1
        return count, segments

    def write_chain(
        self,
        chain: Chain,
        start: int,
        stop: int,
        held: Run | None,
        payload_fn: PayloadFn | None,
        uniform_nbytes: int | None = None,
    ) -> tuple[int, list[tuple[int, int]], bool, Run | None]:
        """Store the blocks ``start..stop-1`` of ``chain`` not stored yet, then hold the
        deepest block reached instead of ``held`` (the caller's run holding block ``start - 1``,
        None when ``start`` is 0), as :meth:`hold_chain` does.

        Blocks already stored (by another request meanwhile, or beyond an alignment cut) are
        verified and kept; runs of new ones go in through :meth:`insert_chain` (see it for
        ``payload_fn`` and ``uniform_nbytes``). Stops at a hash collision or for lack of room.
        Returns (the block reached, the (first, count) ranges inserted, whether it stopped for
        lack of room, the run now held: ``held`` when no block was reached).
        """
        keys, packed = chain.keys, chain.packed
        index = self._tree.index
        now = self._clock()  # (one instant for the inserts and the hold)
        last = held  # the run holding block ``at - 1`` (None at 0)
        ranges: list[tuple[int, int]] = []
        short = False
        at = start
        while at < stop:
            if keys[at] in index:  # stored, or a collision: walk over what is there
                run, count, collided = self._tree.match_run(
                    keys, packed, at, stop, keys[at - 1] if at else None
                )
                if count:
                    last = run
                    at += count
                if collided:
                    break  # the chain cannot continue under this key
                continue
            parent_run = None
            if at:
                assert last is not None  # a block before ``at`` is held, so is its run
                parent_run = last
                if at < parent_run.depth + len(parent_run.keys):  # a new branch off the middle of a run
                    parent_run = last = self._tree.split(parent_run, at - 1 - parent_run.depth)
            # (positional: a keyword call would leave the interpreter's fast path on every request)
            inserted, no_room, run = self._budget.insert(
                chain, at, stop, parent_run, payload_fn, uniform_nbytes, True, now
            )
            if inserted:
                ranges.append((at, inserted))
                last = run
                at += inserted
            if no_room or not inserted:
                short = True
                break
        if at > start:
            held = self.hold_chain(chain, start, at, last, previous=held, now=now)
        return at, ranges, short, held

    def hold_chain(
        self,
        chain: Chain,
        start: int,
        stop: int,
        run: Run | None = None,
        *,
        previous: Run | None = None,
        now: float | None = None,
    ) -> Run:
        """Take a reference on block ``stop - 1`` of the stored ``chain`` and refresh it,
        dropping the reference on ``previous`` (the caller's, or None); raise its blocks
        ``start..stop-1`` to the TTLs asked (``chain.ttls``: a block keeps the longest TTL it was
        asked for). Returns the run whose tail that block now is: the caller
        must :meth:`release` it. ``run``: the run holding the block when the caller knows it
        (else the chain is walked from its root). ``now``: the time of the use (default: the
        clock's).

        Holding the deepest block protects the whole chain (ancestors have a child, so they are
        never evicted or expired), and refreshing it refreshes them.
        """
        if now is None:
            now = self._clock()
        if run is None:
            run = self._tree.locate(chain.keys, stop - 1)[0]
        tail = run if stop == run.depth + len(run.keys) else self._tree.split(run, stop - 1 - run.depth)
        if tail in self._lru:  # (acquire, inlined: this is every request's path)
            self._leaves.leave(tail)
        tail.ref_count += 1
        if previous is not None:
            self.release(previous, now)
        # ttls[start] is the longest asked (asked TTLs never grow along a chain); no block can be
        # below it when no run was ever stored with a shorter class (the usual single-TTL case).
        ttls = chain.ttls
        if ttls[start] > self._budget.min_ttl_s:
            self._raise_ttls(chain, start, stop, tail)
        if ttls[stop - 1] > tail.ttl_s:
            self.touch(tail, ttls[stop - 1], now)
        else:  # (touch, inlined: a held block is in no queue, and its class stays)
            tail.last_used = now
        return tail

    def _raise_ttls(self, chain: Chain, start: int, stop: int, tail: Run) -> None:
        """Raise every block ``start..stop-1`` of ``chain`` stored with a shorter TTL than asked, each
        group of equal asked TTL as a run of its own. None of these blocks is queued (all have a
        child but the tail, which is held), so the order of the raises does not matter."""
        ttls = chain.ttls
        longest = ttls[start]
        segments = self._tree.chain(chain.keys, start, stop)
        if longest <= tail.ttl_s and all(longest <= run.ttl_s for run, _, _ in segments):
            return
        # Deepest run first: a split moves a run's head to a new run and leaves the runs before
        # it alone, so the segments found above stay valid.
        for run, offset, count in reversed(segments):
            first = run.depth + offset  # the segment's first block in the chain
            raised = 0  # the blocks to raise are a prefix: asked TTLs fall along the chain
            while raised < count and ttls[first + raised] > run.ttl_s:
                raised += 1
            current, end = run, first + raised
            while end > first:  # from the last group back to the first
                ttl = ttls[end - 1]
                begin = end - 1
                while begin > first and ttls[begin - 1] == ttl:
                    begin -= 1
                piece = self._tree.split(current, end - 1 - current.depth)
                rest = self._tree.split(piece, begin - 1 - piece.depth) if begin > piece.depth else None
                self.raise_ttl(piece, ttl)
                if rest is None:
                    break
                current, end = rest, begin

    def snapshots(self, keys: Sequence[BlockHash], *, missing_ok: bool = False) -> list[Block]:
        """Snapshots of the stored blocks ``keys``: a chain from depth 0 (O(blocks)), or any keys
        with ``missing_ok``, which skips those not stored (a scan per inner key: admin use)."""
        if missing_ok:
            return [block for block in map(self._tree.get, keys) if block is not None]
        segments = self._tree.chain(list(keys), 0, len(keys))
        return [run.block(offset + n) for run, offset, count in segments for n in range(count)]

    def lru_order(self) -> list[BlockHash]:
        """The evictable leaves' keys (each leaf run's tail), least recently used first (O(n))."""
        return [run.keys[-1] for run in self._lru]

    def expiry_order(self) -> dict[float, list[BlockHash]]:
        """Per TTL class, the evictable leaves' keys in their expiry queue's order (O(n))."""
        return {ttl: [run.keys[-1] for run in queue] for ttl, queue in self._expiry.items()}

    # ------------------------------------------------------------------ uses and references
    def touch(self, run: Run, ttl_s: float | None = None, now: float | None = None) -> None:
        """A use of ``run``'s tail at ``now`` (default: the clock's): refresh the TTL (to the
        longest class ever asked) and the LRU position. Touch the deepest block of a hit; its
        ancestors' freshness follows from it."""
        if ttl_s is not None and ttl_s > run.ttl_s and len(run.keys) > 1:
            self._tree.split(run, len(run.keys) - 2)  # only the tail moves to the longer class
        queued = run in self._lru
        if queued:
            self._leaves.leave(run)
        if ttl_s is not None and ttl_s > run.ttl_s:
            run.ttl_s = float(ttl_s)
        run.last_used = self._clock() if now is None else now
        if queued:
            self._leaves.enter(run)

    def raise_ttl(self, run: Run, ttl_s: float) -> None:
        """Move every block of ``run`` to a longer TTL class (no-op if it already has one at
        least as long). Split first to raise part of a run."""
        if ttl_s > run.ttl_s:
            if run in self._lru:  # only its expiry queue changes; its LRU position stays
                self._leaves.reclass(run, ttl_s)
            else:
                run.ttl_s = float(ttl_s)

    def acquire(self, run: Run) -> None:
        """Take a reference on ``run``'s tail: neither it nor any ancestor can be evicted or
        expired until it is released (ancestors are protected by having a child)."""
        if run in self._lru:
            self._leaves.leave(run)
        run.ref_count += 1

    def release(self, run: Run, now: float | None = None) -> None:
        """Drop a reference. The block's use ends now (``now``, default: the clock's): its TTL
        and LRU position are refreshed."""
        if run.ref_count <= 0:
            raise RuntimeError(f"release of block {run.keys[-1].hex()[:12]} that holds no reference")
        run.ref_count -= 1
        if run.ref_count == 0 and run.keys:
            run.last_used = self._clock() if now is None else now
            if run.pin_count == 0 and run.n_children == 0:
                self._leaves.enter(run)

    # ------------------------------------------------------------------ pins
    def pin(self, run: Run) -> None:
        """Exempt a one-block run from TTL and eviction; its bytes move to the pinned budget.
        Pin root-first (see :meth:`isolate`). Raises :class:`PinBudgetExceeded`, changing nothing."""
        if run.pin_count == 0:
            budget = self._budget
            if budget.pinned_bytes + run.nbytes > budget.pinned_capacity_bytes:
                raise PinBudgetExceeded(
                    f"pinning needs {run.nbytes} more bytes but the pinned budget has "
                    f"{budget.pinned_capacity_bytes - budget.pinned_bytes} free; raise pinned_capacity_bytes "
                    "or unpin another prefix"
                )
            if run in self._lru:
                self._leaves.leave(run)
            budget.to_pinned(run)
        run.pin_count += 1

    def unpin(self, run: Run) -> None:
        """Undo one :meth:`pin`. Unpin tail-first.

        When the last pin goes, the bytes return to the main budget, evicting LRU leaves if
        needed; if no room can be made the block itself is evicted. A block still referenced by
        a request, or with cached children that cannot be evicted (held or pinned), cannot be
        squeezed out that way: then :class:`CacheFullError` is raised and nothing changes (retry
        once the request has ended).
        """
        if run.pin_count <= 0:
            raise RuntimeError(f"unpin of block {run.keys[-1].hex()[:12]} that is not pinned")
        if run.pin_count > 1:
            run.pin_count -= 1
            return
        # (no tenant: its bytes are the tenant's already, so room comes from the LRU)
        room = self._budget.make_room(run.nbytes, run, None)
        if not room and (run.ref_count or run.n_children):
            raise CacheFullError(
                "cannot unpin a block that a running request holds while the cache is full; "
                "retry after the request ends"
            )
        run.pin_count = 0
        self._budget.from_pinned(run)
        run.last_used = max(run.last_used, self._clock())
        if run.ref_count == 0 and run.n_children == 0:
            self._leaves.enter(run)
            if not room:
                self._leaves.leave(run)
                self._budget.drop(run, len(run.keys), "capacity", requeue=True)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert every invariant (structure, accounting, queues). O(n): for tests and
        debugging, not the hot path."""
        self._budget.check()

    # (last: in the class body, the name ``bytes`` would hide the type in the annotations above)
    @property
    def bytes(self) -> int:
        """Bytes of the unpinned blocks."""
        return self._budget.bytes
