"""LeafQueues: the evictable leaves of the store, in LRU order and in order of expiry.

Only *leaves* (runs whose tail has no cached child, no reference and no pin) are ever evicted or
expired, so a chain is trimmed from its tail and never orphaned in the middle. Each such run is in
two queues at once:

* ``lru``: least recently used first. A block that becomes a leaf because its child was evicted
  from the front inherits the child's time, which is the oldest, so it enters at the front
  (``enter(run, ordered=True)``).
* ``expiry[ttl]``: one queue per TTL class (300 s, 3600 s, ...), in order of expiry, so a sweep
  pops only what is due. A leaf can enter behind leaves that expire after it (a block touched
  while it had a child, which it outlives, becomes a leaf when the child goes); such a leaf also
  goes on the class's *late heap*, and :meth:`pop_due` takes the earlier of the queue's front and
  the heap's top, so it is removed on time.

This class orders runs and nothing else: it never changes a run, frees bytes or reads the clock.
The store decides what enters and leaves (see :mod:`prefixcache.cache.store`). ``lru`` and
``expiry`` are read directly by the store for membership (``run in leaves.lru``: the hot path
cannot afford a method call there); only this class reorders them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from prefixcache.cache.blocks import Run, expires


class LeafQueues:
    """The LRU queue, one expiry queue per TTL class, and each class's late heap."""

    __slots__ = ("lru", "expiry", "classes", "_late", "_latest", "_seq")

    def __init__(self) -> None:
        self.lru: OrderedDict[Run, None] = OrderedDict()  # runs whose tail is an evictable leaf
        self.expiry: dict[float, OrderedDict[Run, None]] = {}
        self.classes: list[float] = []  # the keys of ``expiry``, sorted (rebound, never mutated)
        # Per class: leaves queued behind leaves that expire after them, as (expiry, seq, run),
        # and the latest expiry queued in order (see enter).
        self._late: dict[float, list[tuple[float, int, Run]]] = {}
        self._latest: dict[float, float] = {}
        self._seq = 0

    # ------------------------------------------------------------------ entering and leaving
    def enter(self, run: Run, *, ordered: bool = False, lru: bool = True) -> None:
        """Queue an evictable leaf (not queued yet). By default as the most recent; with
        ``ordered``, at the front of each queue when it is at least as early as the front there
        (a parent inheriting an evicted child's time). ``lru`` False: its expiry queue only
        (:meth:`reclass`: its LRU position stays).

        In its expiry queue, a leaf that expires before the latest expiry queued in order (a
        parent touched below its child outlives the child, then becomes a leaf) stays at the back
        and also goes on the class's late heap, where :meth:`pop_due` finds it in time."""
        if lru:
            order = self.lru
            order[run] = None
            if ordered and len(order) > 1 and run.last_used <= next(iter(order)).last_used:
                order.move_to_end(run, last=False)
        ttl = run.ttl_s
        queue = self.expiry.get(ttl)
        if queue is None:
            queue = self._new_class(ttl)
        queue[run] = None
        when = run.last_used + ttl
        if ordered and len(queue) > 1:
            front = next(iter(queue))
            if when <= front.last_used + front.ttl_s:
                queue.move_to_end(run, last=False)
                return
        if when < self._latest.get(ttl, when):
            self._seq += 1
            heapq.heappush(self._late[ttl], (when, self._seq, run))
        else:
            self._latest[ttl] = when

    def leave(self, run: Run) -> None:
        """Unqueue a queued leaf (it gained a child, a reference or a pin, or is being removed)."""
        del self.lru[run]
        del self.expiry[run.ttl_s][run]

    def reclass(self, run: Run, ttl_s: float) -> None:
        """Move a queued ``run`` to the longer TTL class ``ttl_s`` (set on the run here): its LRU
        position stays, it enters the new class's queue as :meth:`enter` with ``ordered`` would."""
        del self.expiry[run.ttl_s][run]
        run.ttl_s = float(ttl_s)
        if not self.expiry.get(run.ttl_s):
            # (an empty class is made anew, its stale late entries dropped: as it always was)
            self._new_class(run.ttl_s)
        self.enter(run, ordered=True, lru=False)

    # ------------------------------------------------------------------ what goes next
    def first(self) -> Run | None:
        """The least recently used leaf, or None."""
        return next(iter(self.lru), None)

    def pop_victim(self, protect: Run | None) -> tuple[Run, Run | None] | None:
        """Unqueue and return the least recently used leaf other than ``protect``, with the first
        run left in the LRU (None if none), or None when there is no such leaf. A victim that
        keeps blocks goes back with ``enter(victim, ordered=True)``: exactly where leaves
        inheriting its time would go."""
        others = iter(self.lru)
        victim = next(others, None)
        if victim is protect and victim is not None:
            front: Run | None = victim
            victim = next(others, None)
        else:
            front = next(others, None)
        if victim is None:
            return None
        del self.lru[victim]
        del self.expiry[victim.ttl_s][victim]
        return victim, front

    def pop_due(self, ttl: float, now: float) -> tuple[Run, Run | None] | None:
        """Unqueue and return the leaf of class ``ttl`` that expires first, if it is due at
        ``now``, with the class's next leaf to expire after it (None when none is left). None
        when nothing of the class is due."""
        queue = self.expiry[ttl]
        if not queue:
            return None
        if self._late[ttl]:  # the earlier of the queue's front and the late heap's top
            run = self.next_due(ttl)
            if run.last_used + run.ttl_s > now:
                return None
            del self.lru[run]
            del queue[run]
            return run, (self.next_due(ttl) if queue else None)
        others = iter(queue)
        run = next(others)
        if run.last_used + run.ttl_s > now:
            return None
        after = next(others, None)  # the queue's front once ``run`` has left
        del self.lru[run]
        del queue[run]
        return run, after

    def none_before(self, ttl: float, when: float) -> bool:
        """True when no queued leaf of class ``ttl`` expires before ``when``."""
        return not self.expiry[ttl] or when <= expires(self.next_due(ttl))

    def next_due(self, ttl: float) -> Run:
        """The next leaf of a non-empty class to expire: the queue's front or, when it expires
        earlier, the late heap's top (entries whose leaf left or was refreshed are dropped)."""
        queue = self.expiry[ttl]
        front = next(iter(queue))
        late = self._late[ttl]
        while late:
            when, _, run = late[0]
            if run not in queue or run.last_used + run.ttl_s != when:
                heapq.heappop(late)
                continue
            return run if when < expires(front) else front
        return front

    # ------------------------------------------------------------------ internals
    def _new_class(self, ttl: float) -> OrderedDict[Run, None]:
        queue = self.expiry[ttl] = OrderedDict()
        self._late[ttl] = []
        self.classes = sorted(self.expiry)
        return queue

    def check(self, is_leaf: dict[Run, bool]) -> None:
        """Assert that exactly the runs marked True in ``is_leaf`` (every live run) are queued,
        each in its class, and that the classes are in order. O(n)."""
        for run, leaf in is_leaf.items():
            assert (run in self.lru) == leaf, "LRU membership disagrees with 'evictable leaf'"
            assert (run in self.expiry.get(run.ttl_s, {})) == leaf, "expiry queue disagrees"
        assert len(self.lru) == sum(len(queue) for queue in self.expiry.values()), "LRU and expiry disagree"
        assert all(run in is_leaf for run in self.lru), "a dropped run is queued"
        assert self.classes == sorted(self.expiry), "TTL classes out of order"
