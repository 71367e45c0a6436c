"""Reference model for the differential tests: the block-per-object BlockStore that the run-based
store in ``prefixcache.cache.store`` replaced (prefixcache 0.1.0, kept verbatim apart from this
line, its imports, ``lru_order`` and ``expiry_order`` (the queues' order, read by the differential
test) and one fix both stores share: a leaf queued out of expiry order is also kept
in its class's *late* heap, so a sweep removes it when it is due; before, it waited behind
later-expiring leaves and lookups served it past its TTL). ``test_runs_match_reference.py`` replays random operation sequences through
both and requires identical hits, writes, evictions (which blocks, in which order, for which
reason), counters and per-block state.

BlockStore: cached blocks, reference counts, a byte budget, TTLs, LRU eviction and pins.

The store knows blocks, never requests. Only *leaves* (blocks with no cached child) are ever
evicted or expired, so a chain is trimmed from its tail and never orphaned in the middle. That
rule also makes every per-request operation O(1) instead of O(prefix length):

* A request holds one reference, on the deepest block of its prefix: every ancestor has a
  child, so none of them can be evicted or expired while the request runs.
* A hit refreshes only that deepest block. An ancestor's freshness is the freshest of its
  subtree: when a block's last child goes, the block inherits the child's last use and expiry.
* ``_lru``: the evictable leaves (unreferenced, unpinned, childless), least recently used first.
  A block that becomes a leaf because its child was evicted from the front inherits the
  child's time, which is the oldest, so it enters at the front: the order stays exact.
* ``_expiry``: one ordered dict per TTL class (300 s, 3600 s, ...) of the same leaves, in order
  of expiry, so a sweep pops only what is due. A leaf that enters behind leaves that expire
  after it (a parent touched below its child, which outlives the child) is also pushed on the
  class's ``_late`` heap; a sweep takes the earlier of the queue's front and the heap's top.
  Lookups also check expiry, so a block that a sweep has not reached yet is never served.
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
    """One full block of cached prompt state. ``payload`` is opaque to the cache."""

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
    hits: int = 0
    evicted_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    @property
    def evictable(self) -> bool:
        return self.ref_count == 0 and self.pin_count == 0


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
        self._blocks: dict[BlockHash, Block] = {}
        self._lru: OrderedDict[BlockHash, Block] = OrderedDict()
        self._expiry: dict[float, OrderedDict[BlockHash, Block]] = {}
        self._late: dict[float, list[tuple[float, int, BlockHash]]] = {}  # per class: (expiry, seq, key)
        self._latest: dict[float, float] = {}  # per class: the latest expiry queued in order
        self._seq = 0
        self._listeners: list[Listener] = []
        self.bytes = 0  # unpinned blocks
        self.pinned_bytes = 0
        self.pinned_blocks = 0
        self.tenant_blocks: dict[str, int] = {}
        self.tenant_bytes: dict[str, int] = {}
        self.counters = StoreCounters()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __iter__(self) -> Iterator[Block]:
        return iter(list(self._blocks.values()))

    def get(self, key: BlockHash) -> Block | None:
        return self._blocks.get(key)

    def lru_order(self) -> list[BlockHash]:
        """The evictable leaves' keys, least recently used first."""
        return list(self._lru)

    def expiry_order(self) -> dict[float, list[BlockHash]]:
        """Per TTL class, the evictable leaves' keys in their expiry queue's order."""
        return {ttl: list(queue) for ttl, queue in self._expiry.items()}

    def lookup(self, key: BlockHash, tokens: bytes, parent: BlockHash | None) -> Block | None:
        """The live block stored under ``key`` if it holds exactly ``tokens`` after ``parent``.

        A key whose tokens or parent differ is a hash collision: counted, never served.
        Does not touch the block.
        """
        block = self._blocks.get(key)
        if block is None:
            return None
        if block.tokens != tokens or block.parent != parent:
            self.counters.collisions += 1
            return None
        if block.key in self._lru and block.expires_at <= self.clock():
            return None  # due; the next sweep removes it
        return block

    def is_due(self, block: Block, now: float) -> bool:
        """True when ``block`` is an expired leaf that a sweep has not removed yet."""
        return block.expires_at <= now and block.key in self._lru

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    # ------------------------------------------------------------------ mutation
    def insert(
        self,
        key: BlockHash,
        parent: BlockHash | None,
        tokens: bytes,
        payload: Any,
        nbytes: int,
        *,
        namespace: bytes,
        tenant: str,
        ttl_s: float,
    ) -> Block | None:
        """Store a new unreferenced block, evicting LRU leaves to make room.

        Returns None (and stores nothing) when the key exists, the parent is missing, or there
        is no room even after evicting everything evictable. The caller usually acquires the
        returned block at once.
        """
        if key in self._blocks:
            return None
        parent_block = None
        if parent is not None:
            parent_block = self._blocks.get(parent)
            if parent_block is None:
                return None
        if nbytes > self.capacity_bytes or not self._make_room(nbytes, protect=parent_block):
            self.counters.rejected += 1
            return None
        now = self.clock()
        block = Block(
            key=key,
            parent=parent,
            tokens=tokens,
            payload=payload,
            nbytes=int(nbytes),
            namespace=namespace,
            tenant=tenant,
            depth=0 if parent_block is None else parent_block.depth + 1,
            ttl_s=float(ttl_s),
            expires_at=now + ttl_s,
            last_used=now,
        )
        self._blocks[key] = block
        if parent_block is not None:
            if parent_block.n_children == 0 and parent_block.key in self._lru:
                self._leave(parent_block)  # no longer a leaf
            parent_block.n_children += 1
        self.bytes += block.nbytes
        self.tenant_blocks[tenant] = self.tenant_blocks.get(tenant, 0) + 1
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + block.nbytes
        self._enter(block)
        for fn in self._listeners:
            fn("insert", block)
        return block

    def insert_chain(
        self,
        keys: list[BlockHash],
        parent: BlockHash | None,
        packed: bytes,
        first: int,
        step: int,
        payload_fn: Callable[[int], tuple[Any, int]],
        *,
        namespace: bytes,
        tenant: str,
        ttls: list[float],
        uniform_nbytes: int | None = None,
    ) -> tuple[list[Block], bool]:
        """Insert a chain of new blocks: ``keys[j]`` holds ``packed[j*step:(j+1)*step]`` and
        its payload ``payload_fn(j)``, for j from ``first``, each the child of the previous.

        Exactly what :meth:`insert` block by block does (same evictions, same queue order,
        same listener calls), minus the work on the chain's inner blocks, which would enter
        the LRU and expiry queues as a leaf only to leave them at the next insert. Stops before
        a key that is already stored. Returns (the blocks inserted, whether it stopped for lack
        of room); the caller acquires the last block at once.

        ``uniform_nbytes``: every payload has this size (the caller promises it), so room for the
        whole run is made before the first insert: the same victims, in the same order, as
        making room block by block (the run's blocks are never victims), but a victim's parent
        that becomes the front leaf is evicted straight away instead of queued and dequeued.
        """
        blocks = self._blocks
        parent_block = None
        if parent is not None:
            parent_block = blocks.get(parent)
            if parent_block is None:
                return [], True
        out: list[Block] = []
        cap = self.capacity_bytes
        clock = self.clock
        listeners = self._listeners
        depth = -1 if parent_block is None else parent_block.depth
        no_room = False
        if uniform_nbytes is not None and uniform_nbytes <= cap:
            k = 0
            for j in range(first, len(keys)):
                if keys[j] in blocks:
                    break
                k += 1
            if self.bytes + k * uniform_nbytes > cap:
                # If this fails, everything evictable is gone and the loop stops where the
                # block-by-block path would.
                self._make_room(k * uniform_nbytes, protect=parent_block)
        prev: Block | None = None
        for j in range(first, len(keys)):
            key = keys[j]
            if key in blocks:
                break
            payload, nbytes = payload_fn(j)
            if nbytes > cap or (
                self.bytes + nbytes > cap
                and not self._make_room(nbytes, protect=parent_block if prev is None else None)
            ):
                self.counters.rejected += 1
                no_room = True
                break
            now = clock()
            depth += 1
            ttl = float(ttls[j])
            nbytes = int(nbytes)
            block = Block(key, parent, packed[j * step : (j + 1) * step], payload, nbytes, namespace, tenant,
                          depth, ttl, now + ttl, now)
            blocks[key] = block
            if prev is not None:
                prev.n_children = 1  # new, never queued
            elif parent_block is not None:
                if parent_block.n_children == 0 and parent_block.key in self._lru:
                    self._leave(parent_block)  # no longer a leaf
                parent_block.n_children += 1
            self.bytes += nbytes
            out.append(block)
            for fn in listeners:
                fn("insert", block)
            prev, parent = block, key
        if out:
            n = len(out)
            nb = sum([b.nbytes for b in out])
            self.tenant_blocks[tenant] = self.tenant_blocks.get(tenant, 0) + n
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + nb
            self._enter(out[-1])
        return out, no_room

    def touch(self, block: Block, ttl_s: float | None = None) -> None:
        """A use: refresh the TTL (to the longest class ever asked) and the LRU position.

        Touch the deepest block of a hit; its ancestors' freshness follows from it.
        """
        queued = block.key in self._lru
        if queued:
            self._leave(block)
        if ttl_s is not None and ttl_s > block.ttl_s:
            block.ttl_s = float(ttl_s)
        now = self.clock()
        block.last_used = now
        block.expires_at = now + block.ttl_s
        if queued:
            self._enter(block)

    def raise_ttl(self, block: Block, ttl_s: float) -> None:
        """Move ``block`` to a longer TTL class (no-op if it already has one at least as long)."""
        if ttl_s > block.ttl_s:
            queued = block.key in self._lru
            if queued:  # only its expiry queue changes; its LRU position stays
                del self._expiry[block.ttl_s][block.key]
            block.expires_at += ttl_s - block.ttl_s
            block.ttl_s = float(ttl_s)
            if queued:
                queue = self._expiry.setdefault(block.ttl_s, OrderedDict())
                queue[block.key] = block
                self._place(queue, block)

    def acquire(self, block: Block) -> None:
        """Take a reference: neither ``block`` nor any ancestor can be evicted or expired until
        it is released (ancestors are protected by having a child)."""
        if block.key in self._lru:
            self._leave(block)
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop a reference. The block's use ends now: its TTL and LRU position are refreshed."""
        if block.ref_count <= 0:
            raise RuntimeError(f"release of block {block.key.hex()[:12]} that holds no reference")
        block.ref_count -= 1
        if block.ref_count == 0 and block.key in self._blocks:
            now = self.clock()
            block.last_used = now
            block.expires_at = now + block.ttl_s
            if block.pin_count == 0 and block.n_children == 0:
                self._enter(block)

    def pin(self, block: Block) -> None:
        """Exempt from TTL and eviction; its bytes move to the pinned budget. Pin root-first."""
        if block.pin_count == 0:
            if self.pinned_bytes + block.nbytes > self.pinned_capacity_bytes:
                raise PinBudgetExceeded(
                    f"pinning needs {block.nbytes} more bytes but the pinned budget has "
                    f"{self.pinned_capacity_bytes - self.pinned_bytes} free; raise pinned_capacity_bytes "
                    "or unpin another prefix"
                )
            if block.key in self._lru:
                self._leave(block)
            self.bytes -= block.nbytes
            self.pinned_bytes += block.nbytes
            self.pinned_blocks += 1
        block.pin_count += 1

    def unpin(self, block: Block) -> None:
        """Undo one :meth:`pin`. Unpin tail-first.

        When the last pin goes, the bytes return to the main budget, evicting LRU leaves if
        needed; if no room can be made the block itself is evicted. A block still referenced by
        a request cannot be squeezed out that way: then :class:`CacheFullError` is raised and
        nothing changes (retry once the request has ended).
        """
        if block.pin_count <= 0:
            raise RuntimeError(f"unpin of block {block.key.hex()[:12]} that is not pinned")
        if block.pin_count > 1:
            block.pin_count -= 1
            return
        room = self._make_room(block.nbytes, protect=block)
        if not room and (block.ref_count or block.n_children):
            raise CacheFullError(
                "cannot unpin a block that a running request holds while the cache is full; "
                "retry after the request ends"
            )
        block.pin_count = 0
        self.pinned_bytes -= block.nbytes
        self.pinned_blocks -= 1
        self.bytes += block.nbytes
        now = self.clock()
        block.last_used = max(block.last_used, now)
        block.expires_at = block.last_used + block.ttl_s
        if block.evictable and block.n_children == 0:
            self._enter(block)
            if not room:
                self._remove(block, "capacity")

    def sweep(self) -> int:
        """Remove every unreferenced, unpinned block whose TTL has passed. O(expired)."""
        now = self.clock()
        removed = 0
        # Removing a leaf can make its parent a due leaf (in this class or a longer one), so
        # repeat until a pass removes nothing. Each pass is O(removed + classes).
        progress = True
        while progress:
            progress = False
            for ttl in sorted(self._expiry):
                queue = self._expiry[ttl]
                while queue:
                    block = self._next(ttl)
                    if block.expires_at > now:
                        break
                    parent = self._remove(block, "ttl", requeue=False)
                    removed += 1
                    progress = True
                    # A parent left a due leaf of this class that would enter at the front of
                    # this queue is the next one popped: remove it without queueing it.
                    while (
                        parent is not None
                        and parent.ttl_s == ttl
                        and parent.expires_at <= now
                        and (not queue or parent.expires_at <= self._next(ttl).expires_at)
                    ):
                        parent = self._remove(parent, "ttl", requeue=False, queued=False)
                        removed += 1
                    if parent is not None:
                        self._enter(parent, ordered=True)
        return removed

    def evict(self, nbytes: int) -> int:
        """Evict LRU leaves until ``nbytes`` are free (or nothing evictable is left).

        Returns the bytes freed. ``evict(0)`` is always safe and evicts nothing.
        """
        before = self.bytes
        self._make_room(nbytes)
        return before - self.bytes

    def remove_where(self, pred: Callable[[Block], bool], reason: str = "flush") -> int:
        """Remove every unreferenced, unpinned block for which ``pred`` holds, leaves first."""
        victims = sorted(
            (b for b in self._blocks.values() if b.evictable and pred(b)), key=lambda b: -b.depth
        )
        n = 0
        for block in victims:
            if block.n_children == 0 and block.key in self._blocks:
                self._remove(block, reason)
                n += 1
        return n

    # ------------------------------------------------------------------ internals
    def _enter(self, block: Block, *, ordered: bool = False) -> None:
        """Queue an evictable leaf. By default as the most recent; with ``ordered``, at the front
        when it is at least as old as the front (a parent inheriting an evicted child's time)."""
        self._lru[block.key] = block
        queue = self._expiry.get(block.ttl_s)
        if queue is None:
            queue = self._expiry[block.ttl_s] = OrderedDict()
        queue[block.key] = block
        if ordered and len(self._lru) > 1 and block.last_used <= next(iter(self._lru.values())).last_used:
            self._lru.move_to_end(block.key, last=False)
        self._place(queue, block, ordered)

    def _place(self, queue: OrderedDict[BlockHash, Block], block: Block, ordered: bool = True) -> None:
        """``block`` was just queued at the back of its class's ``queue``: to the front if
        ``ordered`` and it expires no later than the front; else, if it expires before the latest
        expiry queued in order, it stays at the back and goes on the class's late heap too."""
        ttl = block.ttl_s
        exp = block.expires_at
        if ordered and len(queue) > 1 and exp <= next(iter(queue.values())).expires_at:
            queue.move_to_end(block.key, last=False)
        elif exp < self._latest.get(ttl, exp):
            self._seq += 1
            heapq.heappush(self._late.setdefault(ttl, []), (exp, self._seq, block.key))
        else:
            self._latest[ttl] = exp

    def _next(self, ttl: float) -> Block:
        """The next leaf of a non-empty class to expire: the queue's front or, when earlier, the
        late heap's top (entries whose leaf left or was refreshed are dropped on the way)."""
        queue = self._expiry[ttl]
        front = next(iter(queue.values()))
        late = self._late.get(ttl)
        while late:
            exp, _, key = late[0]
            b = queue.get(key)
            if b is None or b.expires_at != exp:
                heapq.heappop(late)
                continue
            return b if exp < front.expires_at else front
        return front

    def _leave(self, block: Block) -> None:
        del self._lru[block.key]
        del self._expiry[block.ttl_s][block.key]

    def _make_room(self, nbytes: int, protect: Block | None = None) -> bool:
        cap = self.capacity_bytes
        lru = self._lru
        while self.bytes + nbytes > cap:
            victim = None
            for block in lru.values():
                # The front is the victim; the protected block is the parent of the block
                # being inserted, which must survive its child's insertion.
                if block is not protect:
                    victim = block
                    break
            if victim is None:
                return False
            queued = True
            while True:
                parent = self._remove(victim, "capacity", requeue=False, queued=queued)
                if parent is None:
                    break
                # The parent is now an evictable leaf and would enter the queues at the front
                # when it is at least as old as the front (see _enter): then, while room is
                # still needed, it is the next victim, so it is removed without queueing.
                if (
                    self.bytes + nbytes > cap
                    and parent is not protect
                    and (not lru or parent.last_used <= next(iter(lru.values())).last_used)
                ):
                    victim, queued = parent, False
                    continue
                self._enter(parent, ordered=True)
                break
        return True

    def _remove(self, block: Block, reason: str, *, requeue: bool = True, queued: bool = True) -> Block | None:
        """Remove a queued leaf. Its parent, if now a leaf, inherits its freshness.

        With ``requeue`` False, a parent that becomes an evictable leaf is returned instead of
        queued (the caller queues or removes it); ``queued`` False: ``block`` was never queued.
        """
        if queued:
            self._leave(block)
        del self._blocks[block.key]
        orphan = None
        if block.parent is not None:
            parent = self._blocks.get(block.parent)
            if parent is not None:
                parent.n_children -= 1
                if block.last_used > parent.last_used:
                    parent.last_used = block.last_used
                    parent.expires_at = max(parent.expires_at, block.last_used + parent.ttl_s)
                if parent.n_children == 0 and parent.evictable:
                    if requeue:
                        self._enter(parent, ordered=True)
                    else:
                        orphan = parent
        self.bytes -= block.nbytes
        self.tenant_blocks[block.tenant] -= 1
        self.tenant_bytes[block.tenant] -= block.nbytes
        self.counters.evictions[reason] = self.counters.evictions.get(reason, 0) + 1
        block.evicted_reason = reason
        for fn in self._listeners:
            fn("evict", block)
        block.payload = None  # drop the tensor now; listeners have had it
        return orphan

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert every invariant. O(n): for tests and debugging, not the hot path."""
        children: dict[BlockHash, int] = {}
        bytes_, pinned_bytes, pinned = 0, 0, 0
        tenant_blocks: dict[str, int] = {}
        tenant_bytes: dict[str, int] = {}
        for key, b in self._blocks.items():
            assert b.key == key, "block stored under a key that is not its own"
            assert b.ref_count >= 0 and b.pin_count >= 0, "negative reference or pin count"
            if b.parent is not None:
                parent = self._blocks.get(b.parent)
                assert parent is not None, "orphan: a block whose parent is gone"
                assert parent.depth == b.depth - 1, "depth does not follow the chain"
                if b.pin_count:
                    assert parent.pin_count, "a pinned block under an unpinned parent"
                children[b.parent] = children.get(b.parent, 0) + 1
            if b.pin_count:
                pinned_bytes += b.nbytes
                pinned += 1
            else:
                bytes_ += b.nbytes
            tenant_blocks[b.tenant] = tenant_blocks.get(b.tenant, 0) + 1
            tenant_bytes[b.tenant] = tenant_bytes.get(b.tenant, 0) + b.nbytes
        for key, b in self._blocks.items():
            assert b.n_children == children.get(key, 0), "child count is wrong"
            queued = b.evictable and b.n_children == 0
            assert (key in self._lru) == queued, "LRU membership disagrees with 'evictable leaf'"
            assert (key in self._expiry.get(b.ttl_s, {})) == queued, "expiry queue disagrees"
        assert len(self._lru) == sum(len(q) for q in self._expiry.values()), "LRU and expiry disagree"
        assert bytes_ == self.bytes, f"byte count drifted: {self.bytes} recorded, {bytes_} held"
        assert pinned_bytes == self.pinned_bytes and pinned == self.pinned_blocks, "pinned count drifted"
        assert self.bytes <= self.capacity_bytes, "over the byte budget"
        assert self.pinned_bytes <= self.pinned_capacity_bytes, "over the pinned budget"
        assert {t: n for t, n in self.tenant_blocks.items() if n} == tenant_blocks, "tenant blocks drifted"
        assert {t: n for t, n in self.tenant_bytes.items() if n} == {
            t: n for t, n in tenant_bytes.items() if n
        }, "tenant bytes drifted"
