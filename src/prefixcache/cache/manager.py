"""PrefixCache: the request-facing API over the block store.

    m = cache.match(tokens, ns, align_tokens=64)   # longest cached prefix, acquired
    ... prefill tokens[m.cached_tokens:] ...
    cache.commit(m, payload_fn)                    # store the new full blocks
    cache.release(m)                               # always, in a finally

The manager maps a prompt to block keys and hides the store behind typed results; it knows
nothing of tensors (payloads are opaque) or of HTTP. All public methods are thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixcache.cache.clock import Clock, monotonic
from prefixcache.cache.keys import BlockHash, Hasher, Namespace, block_keys, pack_tokens, sha256_hasher
from prefixcache.cache.policy import TtlPlan, TtlPolicy
from prefixcache.cache.stats import CacheStats, Outcome, RequestUsage, TenantCounters
from prefixcache.cache.store import Block, BlockStore, Run

#: block index -> (payload, nbytes); called only for blocks actually stored.
PayloadFn = Callable[[int], tuple[Any, int]]


class Tier(Protocol):
    """A store below memory (disk, Redis) under the same keys. See ``prefixcache.cache.tiers``."""

    name: str
    #: True: every committed block is written at once (shared tiers); False: on eviction only.
    write_through: bool

    def get_many(self, keys: Sequence[BlockHash], tokens: Sequence[bytes]) -> list[tuple[Any, int]]:
        """Payloads of the leading run of ``keys`` held and verified by this tier (may be empty)."""
        ...

    def put(self, block: Block) -> None:
        """Persist one block (key, parent, tokens, payload). Must not raise on backend failure."""
        ...


@dataclass(slots=True, eq=False)
class Match:
    """One request's view of the cache, from :meth:`PrefixCache.match` to ``release``."""

    namespace: Namespace
    prompt_tokens: int
    keys: list[BlockHash]  # every full block of the prompt
    ttls: list[float]  # the TTL each full block is stored or refreshed with
    packed: bytes = field(repr=False)
    block_size: int = 16
    outcome: Outcome = Outcome.MISS
    cached_blocks: int = 0  # the cached prefix: keys[:cached_blocks]
    written_keys: list[BlockHash] = field(default_factory=list)  # blocks this request stored
    skipped_blocks: int = 0
    released: bool = False
    _cache: PrefixCache | None = field(default=None, repr=False)
    _held: Run | None = field(default=None, repr=False)  # the run whose tail (our deepest block) we hold
    _depth: int = 0  # blocks of the prompt covered by _held's chain

    @property
    def cached_tokens(self) -> int:
        return self.cached_blocks * self.block_size

    @property
    def blocks(self) -> list[Block]:
        """Snapshots of the cached prefix's blocks, in order (payloads included). Read them
        before :meth:`PrefixCache.release`: until then the prefix cannot be evicted."""
        return [] if self._cache is None or not self.cached_blocks else self._cache.snapshots(self.keys[: self.cached_blocks])

    @property
    def written(self) -> list[Block]:
        """Snapshots of the blocks this request stored (those still cached)."""
        return [] if self._cache is None else self._cache.snapshots(self.written_keys, missing_ok=True)

    @property
    def usage(self) -> RequestUsage:
        return RequestUsage(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_blocks * self.block_size,
            cache_write_tokens=len(self.written_keys) * self.block_size,
        )


@dataclass(frozen=True, slots=True)
class CommitResult:
    written_blocks: int
    written_tokens: int
    skipped_blocks: int  # full blocks that could not be stored (no room)


class PrefixCache:
    """Exact prefix cache: chained block keys over a :class:`BlockStore`, with tiers below it."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        capacity_bytes: int = 2 << 30,
        pinned_capacity_bytes: int = 256 << 20,
        default_ttl_s: float = 300.0,
        clock: Clock | None = None,
        hasher: Hasher | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.block_size = block_size
        self.clock = clock or monotonic
        self.hasher = hasher or sha256_hasher
        self.policy = TtlPolicy(default_ttl_s=default_ttl_s)
        self.store = BlockStore(capacity_bytes, pinned_capacity_bytes, clock=self.clock)
        self.tiers: list[Tier] = []
        self._lock = threading.RLock()
        self._totals = TenantCounters()
        self._tenants: dict[str, TenantCounters] = {}
        self._written_tokens: dict[str, int] = {}
        self._tier_hits = 0
        self._pins: dict[tuple[bytes, BlockHash], list[BlockHash]] = {}
        #: Set by an engine with a KV pool: turns a payload promoted from a tier into the
        #: engine's own kind (a pool block). None keeps tier payloads as they come.
        self.adopt: Callable[[Any], Any] | None = None

    @property
    def default_ttl_s(self) -> float:
        return self.policy.default_ttl_s

    # ------------------------------------------------------------------ keys
    def namespace(self, fingerprint: str, tenant: str = "default", salt: bytes | str = b"") -> Namespace:
        return Namespace.create(fingerprint, tenant=tenant, salt=salt)

    def block_keys(self, tokens: Sequence[int], ns: Namespace) -> list[BlockHash]:
        return block_keys(tokens, ns, self.block_size, self.hasher)

    # ------------------------------------------------------------------ request path
    def match(
        self,
        tokens: Sequence[int] | None,
        ns: Namespace,
        *,
        align_tokens: int | None = None,
        ttl_s: float | None = None,
        ttl_plan: TtlPlan | None = None,
        keys: list[BlockHash] | None = None,
        packed: bytes | None = None,
    ) -> Match:
        """Find, touch and acquire the longest usable cached prefix of ``tokens``.

        Usable: verified token by token, leaving at least one prompt token to compute, and
        ending on a multiple of ``align_tokens`` (default: the block size). The caller must
        call :meth:`release` once, whatever happens. ``keys`` and ``packed`` may pass what the
        caller already computed (``block_keys(tokens, ns, ...)``, ``pack_tokens(tokens)``): a
        simulator replaying millions of requests hashes each shared prefix once. With ``packed``
        given, ``tokens`` may be None.
        """
        B = self.block_size
        align = align_tokens or B
        if align % B:
            raise ValueError(f"align_tokens ({align}) must be a multiple of block_size ({B})")
        if packed is None:
            if tokens is None:
                raise ValueError("match needs tokens or packed")
            packed = pack_tokens(tokens)
        n = len(packed) >> 2
        if keys is None:
            keys = block_keys(tokens, ns, B, self.hasher, packed=packed)
        elif len(keys) != len(packed) // (4 * B):
            raise ValueError(f"keys has {len(keys)} entries; the prompt has {len(packed) // (4 * B)} full blocks")
        ttls = self.policy.block_ttls(len(keys), B, ttl_s, ttl_plan)
        # Cap: at least one token is computed (there must be logits to sample from), and a hit
        # ends on an alignment boundary (the prefill chunk schedule makes that exact).
        max_blocks = (max(n - 1, 0) // align) * align // B
        store = self.store
        with self._lock:
            store.sweep()
            n_hit, segs = store.walk(keys, packed, max_blocks)
            # Only a leaf can be due (ancestors' freshness is their subtree's), so one check.
            if n_hit and store.is_due(segs[-1][0], n_hit - 1 - segs[-1][0].depth, self.clock()):
                n_hit -= 1
            promoted = 0
            if n_hit < max_blocks and self.tiers:
                promoted = self._promote(keys, packed, n_hit, max_blocks, ns, ttls)
                n_hit += promoted
            usable = (n_hit * B // align) * align // B
            m = Match(namespace=ns, prompt_tokens=n, keys=keys, ttls=ttls, packed=packed, block_size=B,
                      cached_blocks=usable, _cache=self)
            if usable:
                self._hold(m, 0, usable, ttls, at=None if promoted else _at(segs, usable - 1))
                m._depth = usable
                m.outcome = Outcome.HIT if usable == max_blocks else Outcome.PARTIAL
            outcome = m.outcome.value
            self._totals.count(n, usable * B, outcome)
            tc = self._tenants.get(ns.tenant)
            if tc is None:
                tc = self._tenants[ns.tenant] = TenantCounters()
            tc.count(n, usable * B, outcome)
        return m

    def cached_prefix(self, keys: list[BlockHash], packed: bytes) -> int:
        """Blocks of this prompt that a request would find cached now (live, verified), without
        touching anything: what a cache-aware router asks each replica."""
        store = self.store
        with self._lock:
            n, segs = store.walk(keys, packed, len(keys))
            if n and store.is_due(segs[-1][0], n - 1 - segs[-1][0].depth, self.clock()):
                n -= 1
            return n

    def _hold(self, m: Match, start: int, stop: int, ttls: list[float], at: tuple[Run, int] | None = None) -> None:
        """Make block ``stop - 1`` (of the chain ``keys[start:stop]``) the one block ``m`` holds,
        refreshed; raise TTL classes on the way (``ttls`` are the chain's asked TTLs, from 0).

        Holding the deepest block protects the whole chain (ancestors have a child, so they
        are never evicted or expired), and refreshing it refreshes them: O(1) per request
        instead of O(prefix), except where a longer TTL class is asked for. ``at``: the run and
        position of block ``stop - 1`` when the caller knows them (else the chain is walked).
        """
        store = self.store
        keys = m.keys
        tail = store.split(*at) if at is not None else store.tail_at(keys, stop - 1)
        store.acquire(tail)
        if m._held is not None:
            store.release(m._held)
        m._held = tail
        # A block keeps the longest TTL it was asked for; ttls never grow along a chain.
        # ttls[start] is the longest asked (asked TTLs never grow along a chain); no block can be
        # below it when no run was ever stored with a shorter class (the usual single-TTL case).
        if ttls[start] > store.min_ttl_s and (
            ttls[start] > tail.ttl_s or ttls[start] > min([r.ttl_s for r, _, _ in store.chain(keys, start, stop)])
        ):
            # Deepest run first: a split moves a run's head to a new run and leaves the runs
            # before it alone. None of these blocks is queued (all have a child but the tail,
            # which is held), so the order of the raises does not matter.
            for run, j, c in reversed(store.chain(keys, start, stop)):
                i0 = run.depth + j
                q = 0  # the blocks to raise are a prefix: asked TTLs fall along the chain
                while q < c and ttls[i0 + q] > run.ttl_s:
                    q += 1
                cur, e = run, i0 + q
                while e > i0:  # each group of equal asked TTL as a run of its own, from the last
                    v = ttls[e - 1]
                    a = e - 1
                    while a > i0 and ttls[a - 1] == v:
                        a -= 1
                    piece = store.split(cur, e - 1 - cur.depth)
                    rest = store.split(piece, a - 1 - piece.depth) if a > piece.depth else None
                    store.raise_ttl(piece, v)
                    if rest is None:
                        break
                    cur, e = rest, a
        store.touch(tail, ttls[stop - 1])

    def commit(
        self, m: Match, payload_fn: PayloadFn, *, upto_tokens: int | None = None, uniform_nbytes: int | None = None
    ) -> CommitResult:
        """Store the prompt's full blocks after the cached prefix that are not cached yet.

        ``upto_tokens`` stops at the block that ends there (the engine commits only blocks of
        complete prefill chunks). Blocks already present (computed by another request
        meanwhile, or beyond an alignment cut) are kept and acquired, not rewritten. New blocks
        are acquired into ``m``. ``uniform_nbytes``: the caller promises every payload has this
        size (a simulator); room for a run of new blocks is then made in one pass (same victims).
        """
        if m.released:
            raise RuntimeError("commit after release: the match no longer holds its prefix")
        B = self.block_size
        ns = m.namespace
        keys = m.keys
        stop = len(keys) if upto_tokens is None else min(len(keys), max(upto_tokens, 0) // B)
        with self._lock:
            start = m._depth
            held = m._held
            prev = (held, len(held.keys) - 1) if start and held is not None else None  # block start - 1
            i, ranges, prev, short = self._write(ns, keys, m.packed, start, stop, prev, payload_fn, m.ttls,
                                                 uniform_nbytes)
            written = sum(c for _, c in ranges)
            for a, c in ranges:
                m.written_keys.extend(keys[a : a + c])
            if short:
                m.skipped_blocks = stop - i
            if i > start:
                self._hold(m, start, i, m.ttls, at=prev)
                m._depth = i
            tokens_written = written * B
            self._totals.written_tokens += tokens_written
            self._tenants.setdefault(ns.tenant, TenantCounters()).written_tokens += tokens_written
            if written and self.tiers:
                blocks = None
                for tier in self.tiers:
                    if tier.write_through:
                        if blocks is None:
                            chain = self.snapshots(keys[:i])
                            blocks = [chain[x] for a, c in ranges for x in range(a, a + c)]
                        for block in blocks:
                            tier.put(block)
        return CommitResult(written, tokens_written, m.skipped_blocks)

    def _write(
        self, ns: Namespace, keys: list[BlockHash], packed: bytes, start: int, stop: int,
        prev: tuple[Run, int] | None, payload_fn: PayloadFn | None, ttls: list[float], uniform_nbytes: int | None,
    ) -> tuple[int, list[tuple[int, int]], tuple[Run, int] | None, bool]:
        """Commit's walk from block ``start`` (``prev``: the run and position of block
        ``start - 1``): blocks already present (stored meanwhile by another request, or beyond an
        alignment cut) are kept, runs of new ones inserted, each in one call. Returns (the block
        reached, the (first, count) runs written, the run and position of the block before it,
        whether it stopped for lack of room)."""
        store = self.store
        step = 4 * self.block_size
        parent: BlockHash | None = keys[start - 1] if start else None
        ranges: list[tuple[int, int]] = []
        i = start
        while i < stop:
            run, c, collided = store.match_run(keys, packed, i, stop, parent)
            if run is not None:
                if c:
                    prev = (run, i + c - 1 - run.depth)
                    i += c
                    parent = keys[i - 1]
                if collided:
                    break  # the chain cannot continue under this key
                continue
            parent_run = store.split(*prev) if prev is not None else None
            if parent_run is not None:
                prev = (parent_run, len(parent_run.keys) - 1)
            new, no_room, last = store.insert_chain(
                keys, parent, packed, i, step, payload_fn, namespace=ns.root, tenant=ns.tenant, ttls=ttls,
                uniform_nbytes=uniform_nbytes, stop=stop, enter=False, parent_run=parent_run,
            )
            if new and last is not None:
                ranges.append((i, new))
                prev = (last, len(last.keys) - 1)
            i += new
            if no_room or not new:
                return i, ranges, prev, True
            if i < stop and last is not None:
                store._enter(last)  # more follows before the hold: queued as a leaf meanwhile
            parent = keys[i - 1]
        return i, ranges, prev, False

    def replay(
        self,
        ns: Namespace,
        keys: list[BlockHash],
        packed: bytes,
        *,
        nbytes: int,
        ttl_s: float | None = None,
        align_tokens: int | None = None,
        upto_tokens: int | None = None,
    ) -> tuple[int, int]:
        """One whole request for a simulator: exactly ``m = match(None, ns, keys=keys,
        packed=packed, ...)``, ``commit(m, None, uniform_nbytes=nbytes, upto_tokens=...)`` and
        ``release(m)``, with payloads None. Returns (cached tokens, written tokens).

        The same store operations in the same order, minus what a request that ends at once never
        needs (a Match object, the refresh of a block about to be refreshed again). Cases that need
        more (tiers; a longer TTL class than some stored block has) take the three calls.
        """
        B = self.block_size
        align = align_tokens or B
        store = self.store
        base = self.policy.default_ttl_s if ttl_s is None else float(ttl_s)
        if self.tiers or align % B or not 0 < base <= store.min_ttl_s or len(keys) != len(packed) // (4 * B):
            m = self.match(None, ns, align_tokens=align, ttl_s=ttl_s, keys=keys, packed=packed)
            try:
                r = self.commit(m, None, upto_tokens=upto_tokens, uniform_nbytes=nbytes)
            finally:
                self.release(m)
            return m.cached_tokens, r.written_tokens
        n = len(packed) >> 2
        nk = len(keys)
        max_blocks = (max(n - 1, 0) // align) * align // B
        clock = self.clock
        with self._lock:
            # match
            store.sweep()
            n_hit, segs = store.walk(keys, packed, max_blocks)
            if n_hit:
                # store.is_due (only a leaf can be due: ancestors' freshness is their subtree's)
                run = segs[-1][0]
                if (
                    n_hit - run.depth == len(run.keys)
                    and run in store._lru
                    and run.last_used + run.ttl_s <= clock()
                ):
                    n_hit -= 1
            usable = (n_hit * B // align) * align // B
            outcome = "miss" if not usable else "hit" if usable == max_blocks else "partial"
            self._totals.count(n, usable * B, outcome)
            tc = self._tenants.get(ns.tenant)
            if tc is None:
                tc = self._tenants[ns.tenant] = TenantCounters()
            tc.count(n, usable * B, outcome)
            held = None
            lru = store._lru
            if usable:  # hold and touch the deepest hit block (no TTL class to raise: see above)
                held, first, _ = segs[-1]  # _at(segs, usable - 1): most often in the last run
                j = usable - 1 - held.depth
                if j < first:
                    held, j = _at(segs, usable - 1)
                if j < len(held.keys) - 1:
                    held = store.split(held, j)
                if held in lru:
                    store._leave(held)
                held.ref_count += 1
                held.last_used = clock()
            # commit
            stop = nk if upto_tokens is None else min(nk, max(upto_tokens, 0) // B)
            if usable < stop and keys[usable] not in store._index:
                # The usual case: the prompt leaves the cache where the hit ends, so its new blocks
                # are one chain off the held block (what _write's first step would insert).
                written, no_room, tail = store._insert_uniform(keys, held, packed, usable, stop, 4 * B, nbytes,
                                                               ns.root, ns.tenant, base)
                i = usable + written  # when i > usable, block i - 1 is the tail of ``tail``
                if written and not no_room and i < stop:  # stopped at a stored key: a hash collision
                    store._enter(tail)  # more follows before the hold: queued as a leaf meanwhile
                    prev = (tail, len(tail.keys) - 1)  # type: ignore[union-attr]
                    i, ranges, prev, _ = self._write(ns, keys, packed, i, stop, prev, None, [base] * nk, nbytes)
                    written += sum(c for _, c in ranges)
                    tail = store.split(*prev)  # type: ignore[misc]
            else:
                prev = (held, len(held.keys) - 1) if held is not None else None  # block usable - 1
                i, ranges, prev, _ = self._write(ns, keys, packed, usable, stop, prev, None, [base] * nk, nbytes)
                written = sum(c for _, c in ranges)
                if i > usable:
                    tail = store.split(*prev)  # type: ignore[misc]
            if i > usable:  # hold the chain's deepest block instead, touched
                if tail in lru:
                    store._leave(tail)
                tail.ref_count += 1
                if held is not None:
                    store.release(held)
                tail.last_used = clock()
                held = tail
            if written:
                self._totals.written_tokens += written * B
                tc.written_tokens += written * B
            # release: store.release, inlined (the reference is ours, so there is one to drop)
            if held is not None:
                held.ref_count -= 1
                if held.ref_count == 0 and held.keys:
                    held.last_used = clock()
                    if held.pin_count == 0 and held.n_children == 0:
                        store._enter(held)
        return usable * B, written * B

    def release(self, m: Match) -> None:
        """Drop every reference ``m`` holds. Idempotent; call it in a finally."""
        with self._lock:
            if m.released:
                return
            m.released = True
            if m._held is not None:
                self.store.release(m._held)
                m._held = None

    # ------------------------------------------------------------------ keep-warm and admin
    def pin(self, tokens: Sequence[int], ns: Namespace) -> int:
        """Pin the cached full blocks of this prefix (no expiry, no eviction). Returns the
        pinned token count (0 when nothing is cached yet: prefill it first)."""
        keys = self.block_keys(tokens, ns)
        packed = pack_tokens(tokens)
        store = self.store
        with self._lock:
            n, segs = store.walk(keys, packed, len(keys))
            if n and store.is_due(segs[-1][0], n - 1 - segs[-1][0].depth, self.clock()):
                n -= 1
            if not n:
                return 0
            pin_id = (ns.root, keys[n - 1])
            if pin_id in self._pins:
                return n * self.block_size
            runs = [store.isolate(keys, i) for i in range(n)]  # a pinned block is a run of its own
            done: list[Run] = []
            try:
                for run in runs:
                    store.pin(run)
                    done.append(run)
            except BaseException:
                for run in reversed(done):
                    store.unpin(run)
                raise
            self._pins[pin_id] = keys[:n]
            return n * self.block_size

    def unpin(self, tokens: Sequence[int], ns: Namespace) -> int:
        """Undo :meth:`pin` for every pinned prefix of ``tokens``. Returns tokens unpinned."""
        keys = set(self.block_keys(tokens, ns))
        unpinned = 0
        with self._lock:
            for pin_id in [p for p in self._pins if p[0] == ns.root and p[1] in keys]:
                chain = self._pins.pop(pin_id)
                for key in reversed(chain):
                    run = self.store.run_of(key)
                    if run is not None:
                        self.store.unpin(run)
                unpinned = max(unpinned, len(chain) * self.block_size)
        return unpinned

    def pinned_prefixes(self) -> int:
        with self._lock:
            return len(self._pins)

    def flush(self, ns: Namespace) -> int:
        """Remove every unreferenced, unpinned block of this namespace. Returns blocks removed."""
        with self._lock:
            return self.store.remove_where(lambda r: r.namespace == ns.root, reason="flush")

    def sweep(self) -> int:
        with self._lock:
            return self.store.sweep()

    def add_tier(self, tier: Tier) -> None:
        with self._lock:
            if not tier.write_through and not any(not t.write_through for t in self.tiers):
                self.store.add_listener(self._on_store_event)  # write-back tiers take evicted blocks
            self.tiers.append(tier)

    def snapshots(self, keys: Sequence[BlockHash], *, missing_ok: bool = False) -> list[Block]:
        """Snapshots of the stored blocks ``keys`` (a chain from depth 0, or any keys with
        ``missing_ok``, which skips those no longer stored)."""
        with self._lock:
            if missing_ok:
                return [b for b in map(self.store.get, keys) if b is not None]
            return [run.block(j + t) for run, j, c in self.store.chain(list(keys), 0, len(keys)) for t in range(c)]

    def stats(self, tenant: str | None = None) -> CacheStats:
        with self._lock:
            c = self._totals if tenant is None else self._tenants.get(tenant, TenantCounters())
            store = self.store
            ev = dict(store.counters.evictions)
            return CacheStats(
                requests=c.requests,
                queried_tokens=c.queried_tokens,
                hit_tokens=c.hit_tokens,
                written_tokens=c.written_tokens,
                blocks=len(store) if tenant is None else store.tenant_blocks.get(tenant, 0),
                bytes=(store.bytes + store.pinned_bytes) if tenant is None else store.tenant_bytes.get(tenant, 0),
                pinned_blocks=store.pinned_blocks,
                pinned_bytes=store.pinned_bytes,
                capacity_bytes=store.capacity_bytes,
                evictions=ev,
                expirations=ev.get("ttl", 0),
                collisions=store.counters.collisions,
                hits_by_outcome=dict(c.outcomes),
                tier_hits=self._tier_hits,
                tenant=tenant,
            )

    def check_integrity(self) -> None:
        with self._lock:
            self.store.check_integrity()
            for (_, _), chain in self._pins.items():
                for key in chain:
                    run = self.store.run_of(key)
                    assert run is not None and run.pin_count > 0, "a pinned prefix lost a block"

    # ------------------------------------------------------------------ tiers
    def _promote(
        self, keys: list[BlockHash], packed: bytes, start: int, stop: int, ns: Namespace, ttls: list[float]
    ) -> int:
        """Bring the run of blocks ``start..stop`` up from the tiers into memory. Returns how many."""
        step = 4 * self.block_size
        i = start
        for tier in self.tiers:
            if i >= stop:
                break
            base = i
            tokens = [packed[j * step : (j + 1) * step] for j in range(base, stop)]
            for payload, nbytes in tier.get_many(keys[base:stop], tokens):
                if self.adopt is not None:
                    payload = self.adopt(payload)
                n, _, _ = self.store.insert_chain(
                    keys, keys[i - 1] if i else None, packed, i, step, lambda _j, p=payload, nb=nbytes: (p, nb),
                    namespace=ns.root, tenant=ns.tenant, ttls=ttls, stop=i + 1,
                )
                if not n:
                    break
                i += 1
        self._tier_hits += i - start
        return i - start

    def _on_store_event(self, event: str, block: Block) -> None:
        if event == "evict" and block.evicted_reason == "capacity":
            for tier in self.tiers:
                if not tier.write_through:
                    tier.put(block)


def _at(segs: list[tuple[Run, int, int]], i: int) -> tuple[Run, int]:
    """The run and position of block ``i`` among a walk's segments."""
    for run, j, _ in reversed(segs):
        if run.depth + j <= i:
            return run, i - run.depth
    raise IndexError(i)
