"""BlockStore: cached blocks in runs, reference counts, a byte budget, TTLs, LRU eviction and pins.

The store knows blocks, never requests. Only *leaves* (blocks with no cached child) are ever
evicted or expired, so a chain is trimmed from its tail and never orphaned in the middle. That
rule makes every per-request operation O(1) in the prefix length:

* A request holds one reference, on the deepest block of its prefix: every ancestor has a
  child, so none of them can be evicted or expired while the request runs.
* A hit refreshes only that deepest block. An ancestor's freshness is the freshest of its
  subtree: when a block's last child goes, the block inherits the child's last use (and so its
  expiry, which is always ``last_used + ttl_s``).
* ``_lru``: the evictable leaves (unreferenced, unpinned, childless), least recently used first.
  A block that becomes a leaf because its child was evicted from the front inherits the child's
  time, which is the oldest, so it enters at the front.
* ``_expiry``: one ordered dict per TTL class (300 s, 3600 s, ...) of the same leaves, in order
  of expiry, so a sweep pops only what is due. A leaf can enter behind leaves that expire after
  it (a block touched while it had a child, which it outlives, becomes a leaf when the child
  goes); such a leaf also goes on the class's ``_late`` heap, and a sweep takes the earlier of
  the queue's front and the heap's top, so it is removed on time. Lookups also check expiry, so
  a block that a sweep has not reached yet is never served.

**Runs.** Blocks are stored in *runs*: chains of blocks inserted together in which every block
but the last has exactly one child (the next), no reference, the run's TTL class and pin count,
and a last use no later than the last block's. Such inner blocks are indistinguishable until they
become leaves, and then they inherit the run's time, so a run behaves exactly as its blocks one
by one would, at a fraction of the cost: inserting a prompt's new tail is one object, and
evicting or expiring a run's blocks is one step however many go. A run is split, O(run length)
in C, wherever a block must differ from its run: a new branch, a held block, a longer TTL class,
a pin (a pinned prefix is kept as one-block runs). Runs never merge. A run keeps its *tail* when
it splits (the head moves to a new run), so a reference to the run holding a block at its tail
stays valid.

Callers see :class:`Block` snapshots (``get``, iteration, listener events); the store's mutating
methods are for :class:`~prefixcache.cache.manager.PrefixCache`, which holds a lock.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.clock import Clock, monotonic
from prefixcache.cache.keys import BlockHash, unpack_tokens

log = logging.getLogger(__name__)

#: ``fn(event, block)``; events: "insert", "evict" (``block.evicted_reason`` says why).
Listener = Callable[[str, "Block"], None]


class PinBudgetExceeded(RuntimeError):
    """Pinning would exceed the pinned-bytes budget."""


class CacheFullError(RuntimeError):
    """An operation needs room that only blocks in use could give."""


@dataclass(slots=True, eq=False)
class Block:
    """A snapshot of one cached block. ``payload`` is opaque to the cache."""

    key: BlockHash
    parent: BlockHash | None  # None for a prompt's first block
    tokens: bytes  # packed token ids (see keys.pack_tokens): a hit compares them
    payload: Any
    nbytes: int
    namespace: bytes  # the namespace root: flushes and tenant accounting use it
    tenant: str
    depth: int  # 0 for a first block
    ttl_s: float
    expires_at: float
    last_used: float
    ref_count: int = 0
    pin_count: int = 0
    n_children: int = 0
    evicted_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    @property
    def evictable(self) -> bool:
        return self.ref_count == 0 and self.pin_count == 0


class Run:
    """A chain of blocks (see the module docstring). ``keys[i]`` holds
    ``packed[i*step:(i+1)*step]``, ``payloads[i]`` and ``sizes[i]`` bytes, at depth ``depth + i``.
    ``ref_count``, ``last_used`` and ``n_children`` are the last block's; ``ttl_s``, ``pin_count``,
    ``namespace`` and ``tenant`` are every block's. A dropped run has no keys."""

    __slots__ = (
        "keys", "packed", "payloads", "sizes", "nbytes", "unit", "step", "depth", "parent", "up",
        "namespace", "tenant", "ttl_s", "last_used", "ref_count", "pin_count", "n_children",
    )

    def __init__(
        self, keys: list[BlockHash], packed: bytes, payloads: list[Any], sizes: list[int], unit: int,
        depth: int, parent: BlockHash | None, namespace: bytes, tenant: str, ttl_s: float, last_used: float,
        up: Run | None = None,
    ) -> None:
        self.keys = keys
        self.packed = packed
        self.payloads = payloads
        self.sizes = sizes
        self.nbytes = unit * len(keys) if unit else sum(sizes)
        self.unit = unit  # every block's size when they are all equal, else 0
        self.step = len(packed) // len(keys)
        self.depth = depth
        self.parent = parent
        self.up = up  # the run whose last block is this run's parent
        self.namespace = namespace
        self.tenant = tenant
        self.ttl_s = ttl_s
        self.last_used = last_used
        self.ref_count = 0
        self.pin_count = 0
        self.n_children = 0

    def __repr__(self) -> str:
        return f"Run(depth={self.depth}, blocks={len(self.keys)}, tail={self.keys[-1].hex()[:12]})"

    def block(self, j: int, reason: str | None = None) -> Block:
        """A snapshot of block ``j``."""
        last = j == len(self.keys) - 1
        return Block(
            key=self.keys[j],
            parent=self.keys[j - 1] if j else self.parent,
            tokens=self.packed[j * self.step : (j + 1) * self.step],
            payload=self.payloads[j],
            nbytes=self.sizes[j],
            namespace=self.namespace,
            tenant=self.tenant,
            depth=self.depth + j,
            ttl_s=self.ttl_s,
            expires_at=self.last_used + self.ttl_s,
            last_used=self.last_used,
            ref_count=self.ref_count if last else 0,
            pin_count=self.pin_count,
            n_children=self.n_children if last else 1,
            evicted_reason=reason,
        )


@dataclass(slots=True)
class StoreCounters:
    evictions: dict[str, int] = field(default_factory=lambda: {"capacity": 0, "ttl": 0, "flush": 0})
    collisions: int = 0  # a key matched but its tokens did not
    rejected: int = 0  # inserts refused for lack of room


class BlockStore:
    """Blocks under a byte budget, a TTL per block, and a separate budget for pinned blocks.

    Not thread-safe by itself: :class:`~prefixcache.cache.manager.PrefixCache` holds a lock.
    """

    def __init__(
        self,
        capacity_bytes: int = 2 << 30,
        pinned_capacity_bytes: int = 256 << 20,
        clock: Clock = monotonic,
    ) -> None:
        if capacity_bytes < 0 or pinned_capacity_bytes < 0:
            raise ValueError("capacity_bytes and pinned_capacity_bytes must be >= 0")
        self.capacity_bytes = int(capacity_bytes)
        self.pinned_capacity_bytes = int(pinned_capacity_bytes)
        self.clock = clock
        # The first key of every run -> the run. Inner keys are not indexed: a walk enters a run
        # at its first block and compares the rest by tokens (see match_run).
        self._index: dict[BlockHash, Run] = {}
        self._runs: dict[Run, None] = {}  # every live run
        self._nblocks = 0
        self._lru: OrderedDict[Run, None] = OrderedDict()  # runs whose tail is an evictable leaf
        self._expiry: dict[float, OrderedDict[Run, None]] = {}
        self._classes: list[float] = []  # the keys of _expiry, sorted
        # Per class: leaves queued behind leaves that expire after them, as (expiry, seq, run)
        # (see _place), and the latest expiry queued in order.
        self._late: dict[float, list[tuple[float, int, Run]]] = {}
        self._latest: dict[float, float] = {}
        self._seq = 0
        self._listeners: list[Listener] = []
        self.bytes = 0  # unpinned blocks
        self.pinned_bytes = 0
        self.pinned_blocks = 0
        self.tenant_blocks: dict[str, int] = {}
        self.tenant_bytes: dict[str, int] = {}
        self.counters = StoreCounters()
        #: No run was ever stored with a shorter TTL class than this (TTLs only grow after).
        self.min_ttl_s = float("inf")

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return self._nblocks

    def __contains__(self, key: object) -> bool:
        return self._find(key) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Block]:
        """Snapshots of every block (O(n): for tests, admin and debugging)."""
        return iter([r.block(j) for r in list(self._runs) for j in range(len(r.keys))])

    def runs(self) -> list[Run]:
        return list(self._runs)

    def _find(self, key: BlockHash) -> tuple[Run, int] | None:
        """The run and position of the block stored under ``key``: O(1) for a run's first block,
        else a scan (for admin and tests; request paths walk chains instead)."""
        run = self._index.get(key)
        if run is not None and run.keys[0] == key:
            return run, 0
        for r in self._runs:
            if key in r.keys:
                return r, r.keys.index(key)
        return None

    def get(self, key: BlockHash) -> Block | None:
        """A snapshot of the block stored under ``key``, or None."""
        found = self._find(key)
        return None if found is None else found[0].block(found[1])

    def run_of(self, key: BlockHash) -> Run | None:
        """The run holding ``key`` (see :meth:`_find`)."""
        found = self._find(key)
        return None if found is None else found[0]

    def chain(self, keys: list[BlockHash], start: int, stop: int) -> list[tuple[Run, int, int]]:
        """The runs holding ``keys[start:stop]``, a stored chain whose block ``start`` begins a
        run (a root, or the child of a run's last block): (run, first index, count) each."""
        out = []
        index = self._index
        i = start
        while i < stop:
            run = index[keys[i]]
            j = i - run.depth
            c = min(len(run.keys) - j, stop - i)
            out.append((run, j, c))
            i += c
        return out

    def locate(self, keys: list[BlockHash], i: int) -> tuple[Run, int]:
        """The run and position of block ``i`` of a stored chain ``keys`` (walked from its root)."""
        run, j, c = self.chain(keys, 0, i + 1)[-1]
        return run, j + c - 1

    def match_run(
        self, keys: list[BlockHash], packed: bytes, i: int, stop: int, parent: BlockHash | None
    ) -> tuple[Run | None, int, bool]:
        """How many of ``keys[i:stop]`` one run holds, verified, from block ``i`` (whose parent
        must be ``parent``): (the run, count, collided). ``collided``: a block stored under one of
        the keys holds other tokens, another parent or another depth (counted once; the chain
        ends before it). Count 0 without a collision: ``keys[i]`` is not stored."""
        run = self._index.get(keys[i])
        if run is None:
            return None, 0, False
        rk = run.keys
        j = i - run.depth
        n = len(rk)
        if not (0 <= j < n and rk[j] == keys[i]) or (rk[j - 1] if j else run.parent) != parent:
            self.counters.collisions += 1
            return run, 0, True
        c = min(n - j, stop - i)
        # Both chains start from the same key, and a key is a function of its parent key and its
        # tokens, so where the tokens agree the keys agree: one bytes comparison checks the run.
        s = run.step
        rp = run.packed
        if rp[j * s : (j + c) * s] != packed[i * s : (i + c) * s]:
            lo, hi = 0, c - 1  # blocks [0, lo) agree; the first differing block is at most hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if rp[j * s : (j + mid) * s] == packed[i * s : (i + mid) * s]:
                    lo = mid
                else:
                    hi = mid - 1
            if rk[j + lo] == keys[i + lo]:  # same key, other tokens: a collision
                self.counters.collisions += 1
                return run, lo, True
            return run, lo, False  # the prompt leaves the run here
        return run, c, False

    def walk(self, keys: list[BlockHash], packed: bytes, stop: int) -> tuple[int, list[tuple[Run, int, int]]]:
        """How many leading ``keys[:stop]`` of a prompt are stored, verified, and the runs holding
        them: (run, first index, count) each. :meth:`match_run` run after run from the root, with
        its usual outcome inlined.

        Tokens (and parents) are compared so that even a hash collision cannot serve another
        prompt's state. A run is compared in bulk (one bytes comparison, in C).
        """
        index = self._index
        segs: list[tuple[Run, int, int]] = []
        i = 0
        parent: BlockHash | None = None
        while i < stop:
            run = index.get(keys[i])
            if run is None:
                break
            # What match_run finds almost always: the run starts at block i (the index maps each
            # run's first key to it), hangs off ``parent``, and its tokens agree up to ``stop``.
            if run.depth == i and run.parent == parent:
                c = len(run.keys)
                if c > stop - i:
                    c = stop - i
                s = run.step
                # (startswith compares in place: no copy of the prompt's bytes, nor of the run's
                # when the whole run is compared; keys are full blocks, so the lengths suffice)
                if packed.startswith(run.packed if c == len(run.keys) else run.packed[: c * s], i * s):
                    segs.append((run, 0, c))
                    i += c
                    parent = keys[i - 1]
                    continue
            # Anything else (the prompt leaves the run, a collision) is match_run's to sort out.
            run, c, collided = self.match_run(keys, packed, i, stop, parent)
            if c:
                segs.append((run, i - run.depth, c))  # type: ignore[union-attr]
                i += c
                parent = keys[i - 1]
            if collided or not c:
                break
        return i, segs

    def is_due(self, run: Run, j: int, now: float) -> bool:
        """True when block ``j`` of ``run`` is an expired leaf that a sweep has not removed yet."""
        return j == len(run.keys) - 1 and run in self._lru and run.last_used + run.ttl_s <= now

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    # ------------------------------------------------------------------ mutation
    def split(self, run: Run, j: int) -> Run:
        """Make block ``j`` of ``run`` a tail: blocks ``..j`` move to a new run (returned), the
        rest stay in ``run``. No-op (returns ``run``) when ``j`` is already its tail."""
        n = len(run.keys)
        if j >= n - 1:
            return run
        s = run.step
        c = j + 1
        head = Run(run.keys[:c], run.packed[: c * s], run.payloads[:c], run.sizes[:c], run.unit, run.depth,
                   run.parent, run.namespace, run.tenant, run.ttl_s, run.last_used, run.up)
        head.pin_count = run.pin_count
        head.n_children = 1
        index = self._index
        if index.get(head.keys[0]) is run:
            index[head.keys[0]] = head
        del run.keys[:c]
        run.packed = run.packed[c * s :]
        del run.payloads[:c]
        del run.sizes[:c]
        run.nbytes -= head.nbytes
        run.depth += c
        run.parent = head.keys[-1]
        run.up = head
        if run.keys[0] not in index:  # (taken only by a hash collision: then unreachable by key)
            index[run.keys[0]] = run
        self._runs[head] = None
        return head

    def tail_at(self, keys: list[BlockHash], i: int) -> Run:
        """The run of block ``i`` of the stored chain ``keys``, split so that the block is its tail."""
        return self.split(*self.locate(keys, i))

    def isolate(self, keys: list[BlockHash], i: int) -> Run:
        """Block ``i`` of the stored chain ``keys`` as a run of its own."""
        run = self.tail_at(keys, i)
        if len(run.keys) > 1:
            self.split(run, len(run.keys) - 2)
        return run

    def insert_chain(
        self,
        keys: list[BlockHash],
        parent: BlockHash | None,
        packed: bytes,
        first: int,
        step: int,
        payload_fn: Callable[[int], tuple[Any, int]] | None,
        *,
        namespace: bytes,
        tenant: str,
        ttls: list[float],
        uniform_nbytes: int | None = None,
        stop: int | None = None,
        enter: bool = True,
        parent_run: Run | None = None,
    ) -> tuple[int, bool, Run | None]:
        """Insert a chain of new blocks: ``keys[j]`` (at depth ``j``) holds
        ``packed[j*step:(j+1)*step]`` and its payload ``payload_fn(j)``, for j from ``first`` up
        to ``stop`` (default: the end), each the child of the previous, the first a child of
        ``parent`` (``keys[first - 1]``). Stops before a key that is already stored.

        Returns (blocks inserted, whether it stopped for lack of room, the run holding the last
        one); the caller acquires that block at once. Evictions happen block by block exactly as
        one insert each would make them; the chain's own blocks are never victims.

        ``uniform_nbytes``: every payload has this size (the caller promises it), so room for the
        whole chain is made before the first insert (the same victims in the same order). With
        ``payload_fn`` None, every payload is None and ``uniform_nbytes`` is required.

        ``parent_run``: the run whose last block is ``parent`` (found by walking ``keys`` when
        not given). ``enter`` False: the caller acquires the last block before anything else reads the
        queues, so it is not queued as a leaf first (entering at the back and leaving at once
        would change nothing).
        """
        stop = len(keys) if stop is None else stop
        if parent is None:
            parent_run = None
        elif parent_run is None or not parent_run.keys or parent_run.keys[-1] != parent:
            try:
                parent_run = self.tail_at(keys, first - 1)  # a new branch off the middle of a run
            except (KeyError, IndexError):
                return 0, True, None  # the parent is not stored
        if payload_fn is None and uniform_nbytes is None:
            raise ValueError("insert_chain without payload_fn needs uniform_nbytes")
        cap = self.capacity_bytes
        clock = self.clock
        depth0 = 0 if parent_run is None else parent_run.depth + len(parent_run.keys)
        if depth0 != first:
            raise ValueError(f"keys[{first}] follows a block at depth {depth0 - 1}: the chain is not rooted")
        j = first
        k = 0
        if uniform_nbytes is not None and uniform_nbytes <= cap:
            # None of them is stored: a block's key names its whole prefix, and block j is not
            # stored, so no later one is either (barring a hash collision, which a walk's token
            # comparison catches later).
            k = stop - j
            if self.bytes + k * uniform_nbytes > cap:
                # If this fails, everything evictable is gone and the loop stops where the
                # block-by-block path would.
                self._make_room(k * uniform_nbytes, protect=parent_run)
            if payload_fn is None and self.bytes + k * uniform_nbytes <= cap:
                # Room for all k: no eviction can happen between them, so they go in at once.
                if k:
                    self._attach(parent_run)
                    last = self._new_runs(keys, parent, parent_run, packed, j, j + k, step, None,
                                          [uniform_nbytes] * k, uniform_nbytes, namespace, tenant, ttls, clock())
                    self.bytes += k * uniform_nbytes
                    self._account(tenant, k, k * uniform_nbytes)
                    if enter:
                        self._enter(last)
                    return k, False, last
                return 0, False, None
        return self._insert_slow(keys, parent, parent_run, packed, j, stop, step, payload_fn, namespace, tenant,
                                 ttls, uniform_nbytes, 0, enter)

    def _insert_uniform(
        self, keys: list[BlockHash], parent_run: Run | None, packed: bytes, first: int, stop: int, step: int,
        nbytes: int, namespace: bytes, tenant: str, ttl: float,
    ) -> tuple[int, bool, Run | None]:
        """The simulator's insert: ``insert_chain(keys, parent, packed, first, step, None,
        uniform_nbytes=nbytes, ttls=[ttl] * len(keys), stop=stop, enter=False,
        parent_run=parent_run)`` (``parent``: ``keys[first - 1]``, None when ``first`` is 0), the
        same operations in the same order. The caller has walked the chain: ``first < stop``,
        ``keys[first]`` is not stored, and ``parent_run`` is the run whose tail is block
        ``first - 1`` (None when ``first`` is 0).

        Every block has one size and one TTL class, so when room for all of them can be made they
        go in as one run, with no per-block lists to build; else this is insert_chain itself.
        """
        parent = keys[first - 1] if first else None
        cap = self.capacity_bytes
        if nbytes > cap:  # (no block fits: rejected)
            return self.insert_chain(keys, parent, packed, first, step, None, namespace=namespace, tenant=tenant,
                                     ttls=[ttl] * len(keys), uniform_nbytes=nbytes, stop=stop, enter=False,
                                     parent_run=parent_run)
        k = stop - first
        total = k * nbytes
        if self.bytes + total > cap and not self._make_room(total, protect=parent_run):
            # Block by block from here, as insert_chain goes on (asking _make_room again would
            # change nothing: everything it could evict is gone).
            return self._insert_slow(keys, parent, parent_run, packed, first, stop, step, None, namespace, tenant,
                                     [ttl] * len(keys), nbytes, 0, False)
        if parent_run is not None:  # _attach: its tail is no longer a leaf
            if parent_run.n_children == 0 and parent_run in self._lru:
                self._leave(parent_run)
            parent_run.n_children += 1
        # _new_runs for one TTL class: one run.
        ttl = float(ttl)
        if ttl < self.min_ttl_s:
            self.min_ttl_s = ttl
        rk = keys[first:stop]
        run = Run(rk, packed[first * step : stop * step], [None] * k, [nbytes] * k, nbytes, first, parent,
                  namespace, tenant, ttl, self.clock(), parent_run)
        index = self._index
        if rk[0] not in index:  # (taken only by a hash collision: then unreachable by key)
            index[rk[0]] = run
        self._runs[run] = None
        self._nblocks += k
        if self._listeners:
            self._notify_inserted(keys, first, stop)
        self.bytes += total
        tenant_blocks = self.tenant_blocks
        tenant_blocks[tenant] = tenant_blocks.get(tenant, 0) + k
        tenant_bytes = self.tenant_bytes
        tenant_bytes[tenant] = tenant_bytes.get(tenant, 0) + total
        return k, False, run

    def _insert_slow(
        self, keys: list[BlockHash], parent: BlockHash | None, parent_run: Run | None, packed: bytes, j: int,
        stop: int, step: int, payload_fn: Callable[[int], tuple[Any, int]] | None, namespace: bytes, tenant: str,
        ttls: list[float], uniform_nbytes: int | None, done: int, enter: bool,
    ) -> tuple[int, bool, Run | None]:
        """Block by block: each may need room, made before it goes in."""
        index = self._index
        cap = self.capacity_bytes
        first = j
        payloads: list[Any] = []
        sizes: list[int] = []
        no_room = False
        last = parent_run if done else None
        while j < stop and keys[j] not in index:
            payload, nbytes = payload_fn(j) if payload_fn is not None else (None, uniform_nbytes)
            nbytes = int(nbytes)  # type: ignore[arg-type]
            if nbytes > cap or (
                self.bytes + nbytes > cap
                and not self._make_room(nbytes, protect=parent_run if j == first and not done else None)
            ):
                self.counters.rejected += 1
                no_room = True
                break
            if j == first:
                self._attach(parent_run)  # its tail is no longer a leaf
            # Until the chain is complete its blocks are in no queue, so they cannot be victims.
            payloads.append(payload)
            sizes.append(nbytes)
            self.bytes += nbytes
            j += 1
        n = j - first
        if n:
            unit = sizes[0] if sizes.count(sizes[0]) == n else 0
            last = self._new_runs(keys, parent, parent_run, packed, first, j, step, payloads, sizes, unit,
                                  namespace, tenant, ttls, self.clock())
            self._account(tenant, n, sum(sizes))
        if enter and last is not None and (n or done):
            self._enter(last)
        return n + done, no_room, last

    def _attach(self, parent_run: Run | None) -> None:
        """``parent_run``'s tail gets a child: it is no longer a leaf."""
        if parent_run is not None:
            if parent_run.n_children == 0 and parent_run in self._lru:
                self._leave(parent_run)
            parent_run.n_children += 1

    def _new_runs(
        self, keys: list[BlockHash], parent: BlockHash | None, up: Run | None, packed: bytes, a: int, b: int,
        step: int,
        payloads: list[Any] | None, sizes: list[int], unit: int, namespace: bytes, tenant: str,
        ttls: list[float], now: float,
    ) -> Run:
        """Runs for the new blocks ``a..b`` (one per TTL class they span); returns the last."""
        run = None
        s = a
        if ttls[b - 1] < self.min_ttl_s:
            self.min_ttl_s = float(ttls[b - 1])
        while s < b:
            ttl = float(ttls[s])
            e = b if ttls[b - 1] == ttl else next(x for x in range(s + 1, b) if ttls[x] != ttl)
            rk = keys[s:e]
            run = Run(rk, packed[s * step : e * step], payloads[s - a : e - a] if payloads is not None else [None] * (e - s),
                      sizes[s - a : e - a], unit, s, parent, namespace, tenant, ttl, now, up)
            if e < b:
                run.n_children = 1
            index = self._index
            if rk[0] not in index:  # (taken only by a hash collision: then unreachable by key)
                index[rk[0]] = run
            self._runs[run] = None
            self._nblocks += e - s
            parent = rk[-1]
            up = run
            s = e
        assert run is not None
        if self._listeners:
            self._notify_inserted(keys, a, b)
        return run

    def _notify_inserted(self, keys: list[BlockHash], a: int, b: int) -> None:
        """Tell the listeners of the blocks just stored in the runs holding ``keys[a:b]``."""
        for r, _, _ in self.chain(keys, a, b):
            for jj in range(len(r.keys)):
                for fn in self._listeners:
                    fn("insert", r.block(jj))

    def _account(self, tenant: str, n: int, nbytes: int) -> None:
        self.tenant_blocks[tenant] = self.tenant_blocks.get(tenant, 0) + n
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + nbytes

    def touch(self, run: Run, ttl_s: float | None = None) -> None:
        """A use of ``run``'s tail: refresh the TTL (to the longest class ever asked) and the LRU
        position. Touch the deepest block of a hit; its ancestors' freshness follows from it."""
        if ttl_s is not None and ttl_s > run.ttl_s and len(run.keys) > 1:
            self.split(run, len(run.keys) - 2)  # only the tail moves to the longer class
        queued = run in self._lru
        if queued:
            self._leave(run)
        if ttl_s is not None and ttl_s > run.ttl_s:
            run.ttl_s = float(ttl_s)
        run.last_used = self.clock()
        if queued:
            self._enter(run)

    def raise_ttl(self, run: Run, ttl_s: float) -> None:
        """Move every block of ``run`` to a longer TTL class (no-op if it already has one at
        least as long). Split first to raise part of a run."""
        if ttl_s > run.ttl_s:
            queued = run in self._lru
            if queued:  # only its expiry queue changes; its LRU position stays
                del self._expiry[run.ttl_s][run]
            run.ttl_s = float(ttl_s)
            if queued:
                queue = self._expiry.get(run.ttl_s) or self._new_class(run.ttl_s)
                queue[run] = None
                self._place(queue, run, True)

    def acquire(self, run: Run) -> None:
        """Take a reference on ``run``'s tail: neither it nor any ancestor can be evicted or
        expired until it is released (ancestors are protected by having a child)."""
        if run in self._lru:
            self._leave(run)
        run.ref_count += 1

    def release(self, run: Run) -> None:
        """Drop a reference. The block's use ends now: its TTL and LRU position are refreshed."""
        if run.ref_count <= 0:
            raise RuntimeError(f"release of block {run.keys[-1].hex()[:12]} that holds no reference")
        run.ref_count -= 1
        if run.ref_count == 0 and run.keys:
            run.last_used = self.clock()
            if run.pin_count == 0 and run.n_children == 0:
                self._enter(run)

    def pin(self, run: Run) -> None:
        """Exempt a one-block run from TTL and eviction; its bytes move to the pinned budget.
        Pin root-first (see :meth:`isolate`)."""
        if run.pin_count == 0:
            if self.pinned_bytes + run.nbytes > self.pinned_capacity_bytes:
                raise PinBudgetExceeded(
                    f"pinning needs {run.nbytes} more bytes but the pinned budget has "
                    f"{self.pinned_capacity_bytes - self.pinned_bytes} free; raise pinned_capacity_bytes "
                    "or unpin another prefix"
                )
            if run in self._lru:
                self._leave(run)
            self.bytes -= run.nbytes
            self.pinned_bytes += run.nbytes
            self.pinned_blocks += len(run.keys)
        run.pin_count += 1

    def unpin(self, run: Run) -> None:
        """Undo one :meth:`pin`. Unpin tail-first.

        When the last pin goes, the bytes return to the main budget, evicting LRU leaves if
        needed; if no room can be made the block itself is evicted. A block still referenced by
        a request, or with cached children that cannot be evicted (held or pinned), cannot be
        squeezed out that way: then :class:`CacheFullError` is raised and nothing changes (retry
        once the request has ended). Before, such a block's bytes went back over the budget.
        """
        if run.pin_count <= 0:
            raise RuntimeError(f"unpin of block {run.keys[-1].hex()[:12]} that is not pinned")
        if run.pin_count > 1:
            run.pin_count -= 1
            return
        room = self._make_room(run.nbytes, protect=run)
        if not room and (run.ref_count or run.n_children):
            raise CacheFullError(
                "cannot unpin a block that a running request holds while the cache is full; "
                "retry after the request ends"
            )
        run.pin_count = 0
        self.pinned_bytes -= run.nbytes
        self.pinned_blocks -= len(run.keys)
        self.bytes += run.nbytes
        run.last_used = max(run.last_used, self.clock())
        if run.ref_count == 0 and run.n_children == 0:
            self._enter(run)
            if not room:
                self._leave(run)
                self._drop(run, len(run.keys), "capacity", requeue=True)

    def sweep(self) -> int:
        """Remove every unreferenced, unpinned block whose TTL has passed. O(expired)."""
        now = self.clock()
        removed = 0
        lru = self._lru
        expiry = self._expiry
        # Removing a leaf can make its parent a due leaf (in this class or a longer one), so
        # repeat until a pass removes nothing. Each pass is O(removed + classes).
        progress = True
        while progress:
            progress = False
            for ttl in self._classes:
                queue = expiry[ttl]
                late = self._late[ttl]  # (one list per class: it may fill while this loop runs)
                while queue:
                    if late:  # the earlier of the queue's front and the late heap's top
                        run = self._next(ttl)
                        due = run.last_used + run.ttl_s
                        if due > now:
                            break
                        del lru[run]
                        del queue[run]
                        front = self._next(ttl) if queue else None
                    else:
                        it = iter(queue)
                        run = next(it)
                        due = run.last_used + run.ttl_s
                        if due > now:
                            break
                        front = next(it, None)  # the queue's front once ``run`` has left
                        del lru[run]  # _leave (this queue is its class's)
                        del queue[run]
                    progress = True
                    # Block by block, the tail's parent would be a due leaf of this class with the
                    # same expiry; it is removed at once when it is at least as early as the
                    # queue's front (else it is queued, at the back).
                    k = len(run.keys) if front is None or due <= front.last_used + front.ttl_s else 1
                    removed += k
                    orphan = self._drop(run, k, "ttl", requeue=False)
                    if run.keys:  # part of the run is left: its new tail is queued
                        self._enter(run, ordered=True)
                        continue
                    while (
                        orphan is not None
                        and orphan.ttl_s == ttl
                        and orphan.last_used + orphan.ttl_s <= now
                        and (not queue or orphan.last_used + orphan.ttl_s <= _expires(self._next(ttl)))
                    ):
                        removed += len(orphan.keys)
                        orphan = self._drop(orphan, len(orphan.keys), "ttl", requeue=False)
                    if orphan is not None:
                        self._enter(orphan, ordered=True)
        return removed

    def evict(self, nbytes: int) -> int:
        """Evict LRU leaves until ``nbytes`` are free (or nothing evictable is left).

        Returns the bytes freed. ``evict(0)`` is always safe and evicts nothing.
        """
        before = self.bytes
        self._make_room(nbytes)
        return before - self.bytes

    def remove_where(self, pred: Callable[[Run], bool], reason: str = "flush") -> int:
        """Remove every unreferenced, unpinned block of the runs for which ``pred`` holds
        (``pred`` sees a run's ``namespace`` and ``tenant``), leaves first."""
        victims = sorted(
            (r for r in self.runs() if r.pin_count == 0 and pred(r)), key=lambda r: -(r.depth + len(r.keys))
        )
        n = 0
        for run in victims:
            if run.n_children == 0 and run.ref_count == 0 and run.keys:
                if run in self._lru:
                    self._leave(run)
                n += len(run.keys)
                self._drop(run, len(run.keys), reason, requeue=True)
        return n

    # ------------------------------------------------------------------ internals
    def _enter(self, run: Run, *, ordered: bool = False) -> None:
        """Queue an evictable leaf. By default as the most recent; with ``ordered``, at the front
        when it is at least as old as the front (a parent inheriting an evicted child's time)."""
        lru = self._lru
        lru[run] = None
        queue = self._expiry.get(run.ttl_s)
        if queue is None:
            queue = self._new_class(run.ttl_s)
        queue[run] = None
        if ordered and len(lru) > 1 and run.last_used <= next(iter(lru)).last_used:
            lru.move_to_end(run, last=False)
        self._place(queue, run, ordered)

    def _place(self, queue: OrderedDict[Run, None], run: Run, ordered: bool) -> None:
        """``run`` was just queued at the back of its class's ``queue``: to the front if
        ``ordered`` and it expires no later than the front. Else, when it expires before the
        latest expiry queued in order (a parent touched below its child outlives the child, then
        becomes a leaf), it stays at the back and also goes on the class's late heap, where
        :meth:`sweep` finds it in time; else it is the latest."""
        exp = run.last_used + run.ttl_s
        ttl = run.ttl_s
        if ordered and len(queue) > 1 and exp <= _expires(next(iter(queue))):
            queue.move_to_end(run, last=False)
        elif exp < self._latest.get(ttl, exp):
            self._seq += 1
            heapq.heappush(self._late[ttl], (exp, self._seq, run))
        else:
            self._latest[ttl] = exp

    def _next(self, ttl: float) -> Run:
        """The next leaf of a non-empty class to expire: the queue's front or, when it expires
        earlier, the late heap's top (entries whose leaf left or was refreshed are dropped)."""
        queue = self._expiry[ttl]
        front = next(iter(queue))
        late = self._late[ttl]
        while late:
            exp, _, run = late[0]
            if run not in queue or run.last_used + run.ttl_s != exp:
                heapq.heappop(late)
                continue
            return run if exp < _expires(front) else front
        return front

    def _new_class(self, ttl: float) -> OrderedDict[Run, None]:
        queue = self._expiry[ttl] = OrderedDict()
        self._late[ttl] = []
        self._classes = sorted(self._expiry)
        return queue

    def _leave(self, run: Run) -> None:
        del self._lru[run]
        del self._expiry[run.ttl_s][run]

    def _make_room(self, nbytes: int, protect: Run | None = None) -> bool:
        """Evict LRU leaves until ``nbytes`` more fit; False when nothing (but ``protect``) is left
        to evict. The victims, their order and where the rest is queued are those of evicting
        one leaf block at a time; a run's blocks go in one step where that changes nothing."""
        cap = self.capacity_bytes
        lru = self._lru
        expiry = self._expiry
        drop = self._drop
        while self.bytes + nbytes > cap:
            # The front is the victim; the protected block is the parent of the block being
            # inserted, which must survive its child's insertion. ``front``: the first queued run
            # other than the victim (one iterator, before anything moves).
            it = iter(lru)
            victim = next(it, None)
            if victim is None:
                return False
            lead = victim is not protect  # the victim is the LRU's first run
            if lead:
                front = next(it, None)
            else:
                front = victim
                victim = next(it, None)
                if victim is None:
                    return False
            queued = True
            while True:
                # Block by block, each parent left inside the run is the next victim when it is
                # at least as old as the front (it inherits the tail's time); else it is queued.
                n = len(victim.keys)
                if front is None or victim.last_used <= front.last_used:
                    need = self.bytes + nbytes - cap
                    unit = victim.unit
                    if unit:
                        k = -(-need // unit)
                        if k > n:
                            k = n
                    else:
                        k, freed, sizes = 0, 0, victim.sizes
                        while freed < need and k < n:
                            k += 1
                            freed += sizes[-k]
                else:
                    k = 1
                if k < n:  # part of the run is left: its new tail is queued where a leaf entering goes
                    drop(victim, k, "capacity", requeue=False)  # (touches no queue: front stands)
                    if queued:
                        # Move it to where _enter(ordered=True) would put it after leaving: the
                        # front of each queue when it is at least as early as the first other
                        # run there, else the back. (Usually it is at the front and stays.)
                        if front is not None:
                            if not victim.last_used <= front.last_used:
                                lru.move_to_end(victim)
                            elif not lead:
                                lru.move_to_end(victim, last=False)
                        queue = expiry[victim.ttl_s]
                        it = iter(queue)
                        r = next(it)
                        lead_q = r is victim
                        if lead_q:
                            r = next(it, None)
                        if r is not None:
                            if not victim.last_used + victim.ttl_s <= r.last_used + r.ttl_s:
                                queue.move_to_end(victim)
                                self._place(queue, victim, False)  # (late, or the latest)
                            elif not lead_q:
                                queue.move_to_end(victim, last=False)
                        else:
                            self._place(queue, victim, False)
                    else:
                        self._enter(victim, ordered=True)
                    break
                if queued:
                    del lru[victim]
                    del expiry[victim.ttl_s][victim]
                orphan = drop(victim, k, "capacity", requeue=False)
                # The run is gone; its parent, if now an evictable leaf, is the next victim
                # while room is needed and it is at least as old as the front.
                if orphan is None:
                    break
                front = next(iter(lru), None)
                if (
                    self.bytes + nbytes > cap
                    and orphan is not protect
                    and (front is None or orphan.last_used <= front.last_used)
                ):
                    # The orphan is in no queue, so ``front`` is also the first run other than it.
                    victim, queued = orphan, False
                    continue
                self._enter(orphan, ordered=True)
                break
        return True

    def _drop(self, run: Run, k: int, reason: str, *, requeue: bool) -> Run | None:
        """Remove the last ``k`` blocks of an unqueued ``run`` (tail first). When the run empties,
        its parent's tail, now possibly a leaf, inherits its freshness; an evictable leaf parent
        is queued (``requeue``) or returned for the caller to queue or remove."""
        keys = run.keys
        n = len(keys)
        cut = n - k
        snaps = [run.block(j, reason) for j in range(n - 1, cut - 1, -1)] if self._listeners else None
        self._nblocks -= k
        freed = run.unit * k if run.unit else sum(run.sizes[cut:])
        self.bytes -= freed
        tenant = run.tenant
        self.tenant_blocks[tenant] -= k
        self.tenant_bytes[tenant] -= freed
        ev = self.counters.evictions
        ev[reason] = ev.get(reason, 0) + k
        if cut:
            run.nbytes -= freed
            del keys[cut:]
            del run.payloads[cut:]
            del run.sizes[cut:]
            run.packed = run.packed[: cut * run.step]
        else:
            index = self._index
            if index.get(keys[0]) is run:
                del index[keys[0]]
            del self._runs[run]
            run.keys = []  # dropped
        if snaps is not None:
            for b in snaps:
                for fn in self._listeners:
                    fn("evict", b)
                b.payload = None  # drop the tensor now; listeners have had it
        if cut:
            return None
        parent = run.up
        if parent is not None:
            parent.n_children -= 1
            if run.last_used > parent.last_used:
                parent.last_used = run.last_used
            if parent.n_children == 0 and parent.ref_count == 0 and parent.pin_count == 0:
                if requeue:
                    self._enter(parent, ordered=True)
                else:
                    return parent
        return None

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert every invariant. O(n): for tests and debugging, not the hot path."""
        runs = self.runs()
        children: dict[int, int] = {}
        bytes_, pinned_bytes, pinned = 0, 0, 0
        tenant_blocks: dict[str, int] = {}
        tenant_bytes: dict[str, int] = {}
        nkeys = 0
        for r in runs:
            n = len(r.keys)
            assert n >= 1, "an empty run is live"
            assert len(r.payloads) == n and len(r.sizes) == n and len(r.packed) == n * r.step, "run arrays disagree"
            assert r.nbytes == sum(r.sizes), "run byte count drifted"
            assert not r.unit or all(s == r.unit for s in r.sizes), "a uniform run holds another size"
            assert r.ref_count >= 0 and r.pin_count >= 0, "negative reference or pin count"
            nkeys += n
            if r.parent is not None:
                p = r.up
                assert p is not None and p.keys and p in self._runs, "orphan: a block whose parent is gone"
                assert p.keys[-1] == r.parent, "a run hangs off the middle of another run"
                assert p.depth + len(p.keys) == r.depth, "depth does not follow the chain"
                if r.pin_count:
                    assert p.pin_count, "a pinned block under an unpinned parent"
                children[id(p)] = children.get(id(p), 0) + 1
            else:
                assert r.up is None and r.depth == 0, "a first block not at depth 0"
            if r.pin_count:
                assert n == 1, "a pinned block shares its run"
                pinned_bytes += r.nbytes
                pinned += n
            else:
                bytes_ += r.nbytes
            tenant_blocks[r.tenant] = tenant_blocks.get(r.tenant, 0) + n
            tenant_bytes[r.tenant] = tenant_bytes.get(r.tenant, 0) + r.nbytes
            indexed = self._index.get(r.keys[0])
            assert indexed is not None and indexed.keys[0] == r.keys[0], "a run's first key is not indexed"
        assert nkeys == self._nblocks, "the block count drifted"
        assert all(r in self._runs and r.keys and r.keys[0] == k for k, r in self._index.items()), "a stale index entry"
        for r in runs:
            assert r.n_children == children.get(id(r), 0), "child count is wrong"
            queued = r.ref_count == 0 and r.pin_count == 0 and r.n_children == 0
            assert (r in self._lru) == queued, "LRU membership disagrees with 'evictable leaf'"
            assert (r in self._expiry.get(r.ttl_s, {})) == queued, "expiry queue disagrees"
        assert len(self._lru) == sum(len(q) for q in self._expiry.values()), "LRU and expiry disagree"
        assert self._classes == sorted(self._expiry), "TTL classes out of order"
        assert bytes_ == self.bytes, f"byte count drifted: {self.bytes} recorded, {bytes_} held"
        assert pinned_bytes == self.pinned_bytes and pinned == self.pinned_blocks, "pinned count drifted"
        assert self.bytes <= self.capacity_bytes, "over the byte budget"
        assert self.pinned_bytes <= self.pinned_capacity_bytes, "over the pinned budget"
        assert {t: n for t, n in self.tenant_blocks.items() if n} == tenant_blocks, "tenant blocks drifted"
        assert {t: n for t, n in self.tenant_bytes.items() if n} == {
            t: n for t, n in tenant_bytes.items() if n
        }, "tenant bytes drifted"


def _expires(run: Run) -> float:
    return run.last_used + run.ttl_s

