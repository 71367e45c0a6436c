"""The run tree: cached blocks kept as *runs*, indexed by each run's first key.

A run is a chain of blocks inserted together in which every block but the last has exactly one
child (the next), no reference, the run's TTL class and pin count, and a last use no later than
the last block's. Such inner blocks are indistinguishable until they become leaves, and then they
inherit the run's time, so a run behaves exactly as its blocks one by one would, at a fraction of
the cost: inserting a prompt's new tail is one object, and removing a run's last blocks is one
step however many go. A run is split, O(run length) in C, wherever a block must differ from its
run: a new branch, a held block, a longer TTL class, a pin (a pinned prefix is kept as one-block
runs). Runs never merge. A run keeps its *tail* when it splits (the head moves to a new run), so a
reference to the run holding a block at its tail stays valid.

Only each run's first key is indexed: a walk enters a run at its first block, checks the key, then
compares the rest of the run by tokens in one bytes comparison. Both chains start from the same
key, and a key is a function of its parent key and its tokens, so equal tokens mean equal keys.

:class:`RunTree` knows structure only (keys, tokens, payloads, sizes, depths, which run hangs off
which, and the collisions its walks meet). It never reads the clock and never decides what to keep:
:class:`~prefixcache.cache.budget.BudgetedTree` holds one and adds budgets and removal, and
:class:`~prefixcache.cache.store.BlockStore` holds both and adds references, TTLs and pins. Callers
outside the store see :class:`~prefixcache.cache.blocks.Block` snapshots.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prefixcache.cache.blocks import Block, Chain, Run, Segment, StoreCounters
from prefixcache.cache.keys import BlockHash


class RunTree:
    """Runs indexed by their first key: lookups, walks, splits, adding and cutting runs.

    Not thread-safe, and not used alone: the budget above calls :meth:`add_runs` and :meth:`cut`,
    which change structure and the block count and nothing else (no bytes, queues or listeners).
    """

    def __init__(self) -> None:
        #: The first key of every run -> the run. Inner keys are not indexed: a walk enters a run
        #: at its first block and compares the rest by tokens (see match_run). Read-only outside
        #: the tree (the layers above test membership on their hot paths).
        self.index: dict[BlockHash, Run] = {}
        self._runs: dict[Run, None] = {}  # every live run, in insertion order
        self._nblocks = 0
        self.counters = StoreCounters()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return self._nblocks

    def __contains__(self, key: object) -> bool:
        return self._find(key) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Block]:
        """Snapshots of every block (O(n): for tests, admin and debugging)."""
        return iter([run.block(offset) for run in list(self._runs) for offset in range(len(run.keys))])

    def runs(self) -> list[Run]:
        return list(self._runs)

    def _find(self, key: BlockHash) -> tuple[Run, int] | None:
        """The run and offset of the block stored under ``key``: O(1) for a run's first block,
        else a scan (for admin and tests; request paths walk chains instead)."""
        run = self.index.get(key)
        if run is not None and run.keys[0] == key:
            return run, 0
        for candidate in self._runs:
            if key in candidate.keys:
                return candidate, candidate.keys.index(key)
        return None

    def get(self, key: BlockHash) -> Block | None:
        """A snapshot of the block stored under ``key``, or None."""
        found = self._find(key)
        return None if found is None else found[0].block(found[1])

    def run_of(self, key: BlockHash) -> Run | None:
        """The run holding ``key`` (see :meth:`_find`)."""
        found = self._find(key)
        return None if found is None else found[0]

    def chain(self, keys: list[BlockHash], start: int, stop: int) -> list[Segment]:
        """The runs holding ``keys[start:stop]``, a stored chain whose block ``start`` begins a
        run (a root, or the child of a run's last block). Raises KeyError if it is not stored."""
        segments = []
        index = self.index
        at = start
        while at < stop:
            run = index[keys[at]]
            offset = at - run.depth
            count = min(len(run.keys) - offset, stop - at)
            segments.append((run, offset, count))
            at += count
        return segments

    def locate(self, keys: list[BlockHash], at: int) -> tuple[Run, int]:
        """The run and offset of block ``at`` of a stored chain ``keys`` (walked from its root)."""
        run, offset, count = self.chain(keys, 0, at + 1)[-1]
        return run, offset + count - 1

    def match_run(
        self, keys: list[BlockHash], packed: bytes, at: int, stop: int, parent: BlockHash | None
    ) -> tuple[Run | None, int, bool]:
        """How many of ``keys[at:stop]`` one run holds, verified, from block ``at`` (whose parent
        must be ``parent``): (the run, count, collided). ``collided``: a block stored under one of
        the keys holds other tokens, another parent or another depth (counted in
        ``counters.collisions``; the chain ends before it). Count 0 without a collision:
        ``keys[at]`` is not stored."""
        run = self.index.get(keys[at])
        if run is None:
            return None, 0, False
        run_keys = run.keys
        offset = at - run.depth
        length = len(run_keys)
        if (
            not (0 <= offset < length and run_keys[offset] == keys[at])
            or (run_keys[offset - 1] if offset else run.parent) != parent
        ):
            self.counters.collisions += 1
            return run, 0, True
        count = min(length - offset, stop - at)
        # Both chains start from the same key, and a key is a function of its parent key and its
        # tokens, so where the tokens agree the keys agree: one bytes comparison checks the run.
        step = run.step
        stored = run.packed
        if stored[offset * step : (offset + count) * step] != packed[at * step : (at + count) * step]:
            agree, differ = 0, count - 1  # blocks [0, agree) agree; the first differing is <= differ
            while agree < differ:
                mid = (agree + differ + 1) // 2
                if stored[offset * step : (offset + mid) * step] == packed[at * step : (at + mid) * step]:
                    agree = mid
                else:
                    differ = mid - 1
            if run_keys[offset + agree] == keys[at + agree]:  # same key, other tokens: a collision
                self.counters.collisions += 1
                return run, agree, True
            return run, agree, False  # the prompt leaves the run here
        return run, count, False

    def walk(self, keys: list[BlockHash], packed: bytes, stop: int) -> tuple[int, list[Segment]]:
        """How many leading ``keys[:stop]`` of a prompt are stored, verified, and the segments
        holding them. :meth:`match_run` run after run from the root, with its usual outcome
        inlined (this is the hot path of every request).

        Tokens (and parents) are compared so that even a hash collision cannot serve another
        prompt's state. A run is compared in bulk (one bytes comparison, in C).
        """
        index = self.index
        segments: list[Segment] = []
        at = 0
        parent: BlockHash | None = None
        while at < stop:
            run = index.get(keys[at])
            if run is None:
                break
            # What match_run finds almost always: the run starts at block ``at`` (the index maps
            # each run's first key to it), hangs off ``parent``, and its tokens agree up to ``stop``.
            if run.depth == at and run.parent == parent:
                count = len(run.keys)
                if count > stop - at:
                    count = stop - at
                # (startswith compares in place: no copy of the prompt's bytes, nor of the run's
                # when the whole run is compared; keys are full blocks, so the lengths suffice)
                stored = run.packed if count == len(run.keys) else run.packed[: count * run.step]
                if packed.startswith(stored, at * run.step):
                    segments.append((run, 0, count))
                    at += count
                    parent = keys[at - 1]
                    continue
            # Anything else (the prompt leaves the run, a collision) is match_run's to sort out.
            found, count, collided = self.match_run(keys, packed, at, stop, parent)
            if count:
                assert found is not None  # match_run finds a run whenever it counts blocks
                segments.append((found, at - found.depth, count))
                at += count
                parent = keys[at - 1]
            if collided or not count:
                break
        return at, segments

    # ------------------------------------------------------------------ splits
    def split(self, run: Run, offset: int) -> Run:
        """Make the block at ``offset`` a tail: blocks ``..offset`` move to a new run (returned),
        the rest stay in ``run``. No-op (returns ``run``) when that block is already its tail."""
        if offset >= len(run.keys) - 1:
            return run
        step = run.step
        cut = offset + 1
        head = Run(
            run.keys[:cut],
            run.packed[: cut * step],
            run.payloads[:cut],
            run.sizes[:cut],
            run.unit,
            run.depth,
            run.parent,
            run.namespace,
            run.tenant,
            run.ttl_s,
            run.last_used,
            run.up,
        )
        head.pin_count = run.pin_count
        head.n_children = 1
        index = self.index
        if index.get(head.keys[0]) is run:
            index[head.keys[0]] = head
        del run.keys[:cut]
        run.packed = run.packed[cut * step :]
        del run.payloads[:cut]
        del run.sizes[:cut]
        run.nbytes -= head.nbytes
        run.depth += cut
        run.parent = head.keys[-1]
        run.up = head
        if run.keys[0] not in index:  # (taken only by a hash collision: then unreachable by key)
            index[run.keys[0]] = run
        self._runs[head] = None
        return head

    def tail_at(self, keys: list[BlockHash], at: int) -> Run:
        """The run of block ``at`` of the stored chain ``keys``, split so that the block is its tail."""
        return self.split(*self.locate(keys, at))

    def isolate(self, keys: list[BlockHash], at: int) -> Run:
        """Block ``at`` of the stored chain ``keys`` as a run of its own."""
        run = self.tail_at(keys, at)
        if len(run.keys) > 1:
            self.split(run, len(run.keys) - 2)
        return run

    # ------------------------------------------------------------------ structure changes
    def add_runs(
        self,
        chain: Chain,
        first: int,
        stop: int,
        up: Run | None,
        payloads: list[Any] | None,
        sizes: list[int],
        unit: int,
        now: float,
    ) -> Run:
        """New runs for blocks ``first..stop-1`` of ``chain`` (none stored), the first a child of
        ``up``'s tail: one run per TTL class they span, last used ``now``. Returns the last.
        ``payloads`` (None: every payload is None) and ``sizes`` hold blocks ``first..stop-1``;
        the runs may keep them. Does not touch ``up``'s child count (the caller attaches)."""
        keys, packed, step, ttls = chain.keys, chain.packed, chain.step, chain.ttls
        namespace, tenant = chain.namespace, chain.tenant
        parent = keys[first - 1] if first else None
        index = self.index
        if ttls[stop - 1] == ttls[first]:  # one TTL class, the usual case: one run
            run_keys = keys[first:stop]
            run = Run(
                run_keys,
                packed[first * step : stop * step],
                [None] * (stop - first) if payloads is None else payloads,
                sizes,
                unit,
                first,
                parent,
                namespace,
                tenant,
                float(ttls[first]),
                now,
                up,
            )
            if run_keys[0] not in index:  # (taken only by a hash collision: then unreachable by key)
                index[run_keys[0]] = run
            self._runs[run] = None
            self._nblocks += stop - first
            return run
        start = first
        while start < stop:
            ttl = float(ttls[start])
            end = stop if ttls[stop - 1] == ttl else next(x for x in range(start + 1, stop) if ttls[x] != ttl)
            run_keys = keys[start:end]
            if payloads is None:
                run_payloads: list[Any] = [None] * (end - start)
            else:
                run_payloads = payloads[start - first : end - first]
            run_sizes = sizes[start - first : end - first]
            run = Run(
                run_keys,
                packed[start * step : end * step],
                run_payloads,
                run_sizes,
                unit,
                start,
                parent,
                namespace,
                tenant,
                ttl,
                now,
                up,
            )
            if end < stop:
                run.n_children = 1
            if run_keys[0] not in index:
                index[run_keys[0]] = run
            self._runs[run] = None
            self._nblocks += end - start
            parent = run_keys[-1]
            up = run
            start = end
        return run

    def cut(self, run: Run, count: int, nbytes: int) -> Run | None:
        """Remove the last ``count`` blocks of ``run`` (``nbytes`` in all) from the tree; the
        caller has taken what it needs from them. When the run empties it is dropped (no keys)
        and its parent run, if any, loses a child and inherits the run's last use (a block that
        becomes a leaf inherits its child's freshness): that parent is returned. Else None."""
        keys = run.keys
        keep = len(keys) - count
        self._nblocks -= count
        if keep:
            run.nbytes -= nbytes
            del keys[keep:]
            del run.payloads[keep:]
            del run.sizes[keep:]
            run.packed = run.packed[: keep * run.step]
            return None
        if self.index.get(keys[0]) is run:
            del self.index[keys[0]]
        del self._runs[run]
        run.keys = []  # dropped
        parent = run.up
        if parent is not None:
            parent.n_children -= 1
            if run.last_used > parent.last_used:
                parent.last_used = run.last_used
        return parent

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the structural invariants (runs, index, depths, child counts). O(n)."""
        runs = self.runs()
        children: dict[int, int] = {}
        block_count = 0
        for run in runs:
            length = len(run.keys)
            assert length >= 1, "an empty run is live"
            assert len(run.payloads) == length and len(run.sizes) == length, "run arrays disagree"
            assert len(run.packed) == length * run.step, "run tokens disagree with its keys"
            assert run.nbytes == sum(run.sizes), "run byte count drifted"
            assert not run.unit or all(size == run.unit for size in run.sizes), "a uniform run's sizes differ"
            assert run.ref_count >= 0 and run.pin_count >= 0, "negative reference or pin count"
            block_count += length
            if run.parent is not None:
                up = run.up
                assert up is not None and up.keys and up in self._runs, "orphan: a block whose parent is gone"
                assert up.keys[-1] == run.parent, "a run hangs off the middle of another run"
                assert up.depth + len(up.keys) == run.depth, "depth does not follow the chain"
                if run.pin_count:
                    assert up.pin_count, "a pinned block under an unpinned parent"
                children[id(up)] = children.get(id(up), 0) + 1
            else:
                assert run.up is None and run.depth == 0, "a first block not at depth 0"
            if run.pin_count:
                assert length == 1, "a pinned block shares its run"
            indexed = self.index.get(run.keys[0])
            assert indexed is not None and indexed.keys[0] == run.keys[0], "a run's first key is not indexed"
        assert block_count == self._nblocks, "the block count drifted"
        assert all(
            run in self._runs and run.keys and run.keys[0] == key for key, run in self.index.items()
        ), "a stale index entry"
        for run in runs:
            assert run.n_children == children.get(id(run), 0), "child count is wrong"
