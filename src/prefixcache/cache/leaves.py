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

    __slots__ = ("lru", "expiry", "classes", "earliest", "tenants", "_late", "_latest", "_seq")

    def __init__(self) -> None:
        self.lru: OrderedDict[Run, None] = OrderedDict()  # runs whose tail is an evictable leaf
        self.expiry: dict[float, OrderedDict[Run, None]] = {}
        self.classes: list[float] = []  # the keys of ``expiry``, sorted (rebound, never mutated)
        #: No queued leaf expires before this: a lower bound (leaves may have left since), exact
        #: after a sweep. Lets a sweep with nothing due stop at once.
        self.earliest = float("inf")
        # Per class: leaves queued behind leaves that expire after them, as (expiry, seq, run),
        # and the latest expiry queued in order (see enter).
        self._late: dict[float, list[tuple[float, int, Run]]] = {}
        self._latest: dict[float, float] = {}
        self._seq = 0
        #: With a tenant capacity share (:meth:`track_tenants`): each tenant's leaves, least
        #: recently used first as far as entering puts them (the LRU restricted to the tenant up
        #: to trimmed runs, which keep their place here). None: not kept (no cost).
        self.tenants: dict[str, OrderedDict[Run, None]] | None = None

    def track_tenants(self) -> None:
        """Keep each tenant's leaves in their own queue from now on (O(leaves) once)."""
        if self.tenants is None:
            self.tenants = {}
            for run in self.lru:
                self.tenants.setdefault(run.tenant, OrderedDict())[run] = None

    def tenant_first(self, tenant: str, protect: Run | None) -> Run | None:
        """The tenant's least recently used leaf other than ``protect`` (queued), or None."""
        queue = self.tenants.get(tenant) if self.tenants is not None else None
        for run in queue or ():
            if run is not protect:
                return run
        return None

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
                order.move_to_end(run, False)
            if self.tenants is not None:
                own = self.tenants.get(run.tenant)
                if own is None:
                    own = self.tenants[run.tenant] = OrderedDict()
                own[run] = None
                if ordered and len(own) > 1 and run.last_used <= next(iter(own)).last_used:
                    own.move_to_end(run, False)
        ttl = run.ttl_s
        queue = self.expiry.get(ttl)
        if queue is None:
            queue = self._new_class(ttl)
        queue[run] = None
        when = run.last_used + ttl
        if when < self.earliest:
            self.earliest = when
        if ordered and len(queue) > 1:
            front = next(iter(queue))
            if when <= front.last_used + front.ttl_s:
                queue.move_to_end(run, False)
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
        if self.tenants is not None:
            del self.tenants[run.tenant][run]

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

    def victim(self, protect: Run | None) -> tuple[Run, Run | None, bool] | None:
        """The least recently used leaf other than ``protect``, left queued: (victim, the first
        queued run other than it or None, whether the victim is the LRU's first), or None when
        there is no such leaf."""
        others = iter(self.lru)
        victim = next(others, None)
        if victim is None:
            return None
        if victim is not protect:
            return victim, next(others, None), True
        second = next(others, None)
        return None if second is None else (second, victim, False)

    def requeue_trimmed(self, run: Run, front: Run | None, lead: bool) -> None:
        """``run``, queued, just lost its last blocks to eviction: its new tail inherits nothing
        and is as old as the run was. Move it to exactly where leaving and entering with
        ``ordered`` would put it, in place (no re-insertion: the queues are large ordered dicts).
        ``front`` and ``lead`` are :meth:`victim`'s, from before the blocks went."""
        lru = self.lru
        if front is not None:
            if run.last_used > front.last_used:
                lru.move_to_end(run)
            elif not lead:
                lru.move_to_end(run, False)
        queue = self.expiry[run.ttl_s]
        others = iter(queue)
        first: Run | None = next(others)
        lead_in_class = first is run
        if lead_in_class:
            first = next(others, None)
        if first is not None and run.last_used + run.ttl_s <= first.last_used + first.ttl_s:
            if not lead_in_class:
                queue.move_to_end(run, False)
            return  # (at the front of its class: as enter's ordered placement leaves it)
        # Behind the class's first run, or alone in it: at the back, as enter places it there.
        queue.move_to_end(run)
        when = run.last_used + run.ttl_s
        if when < self._latest.get(run.ttl_s, when):
            self._seq += 1
            heapq.heappush(self._late[run.ttl_s], (when, self._seq, run))
        else:
            self._latest[run.ttl_s] = when

    def pop_due(self, ttl: float, now: float) -> tuple[Run, Run | None] | None:
        """Unqueue and return the leaf of class ``ttl`` that expires first, if it is due at
        ``now``, with the class's next leaf to expire after it (None when none is left). None
        when nothing of the class is due (then :attr:`earliest` takes the class's next expiry:
        after a sweep's last pass over every class it is exact again)."""
        queue = self.expiry[ttl]
        if not queue:
            return None
        late = self._late[ttl]
        if late:  # the earlier of the queue's front and the late heap's top
            run = self.next_due(ttl)
            after = None
        else:
            others = iter(queue)
            run = next(others)
            after = next(others, None)  # the queue's front once ``run`` has left
        when = run.last_used + run.ttl_s
        if when > now:
            if when < self.earliest:
                self.earliest = when
            return None
        del self.lru[run]
        del queue[run]
        if self.tenants is not None:
            del self.tenants[run.tenant][run]
        if late:
            after = self.next_due(ttl) if queue else None
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
        assert all(expires(run) >= self.earliest for run in self.lru), "a leaf expires before 'earliest'"
        if self.tenants is not None:
            own = {run for queue in self.tenants.values() for run in queue}
            assert own == set(self.lru), "the tenants' queues disagree with the LRU"
            assert all(run.tenant == t for t, queue in self.tenants.items() for run in queue), (
                "a leaf in another tenant's queue"
            )
