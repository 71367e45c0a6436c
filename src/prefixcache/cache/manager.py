"""PrefixCache: the request-facing API over the block store.

    m = cache.match(tokens, ns, align_tokens=64)   # longest cached prefix, acquired
    ... prefill tokens[m.cached_tokens:] ...
    cache.commit(m, payload_fn)                    # store the new full blocks
    cache.release(m)                               # always, in a finally

The manager maps a prompt to block keys and hides the store behind typed results; it knows
nothing of tensors (payloads are opaque) or of HTTP. All public methods are thread-safe: one lock
covers the store and the tiers' bookkeeping. It reaches the store through the store's public
methods, the tiers through a :class:`~prefixcache.cache.tiers.stack.TierStack`; a
:class:`~prefixcache.cache.reasons.Explainer` tells why each read ended where it did, and
:func:`~prefixcache.cache.stats.cache_stats` makes the stats snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.cache.blocks import run_of
from prefixcache.cache.clock import Clock, monotonic
from prefixcache.cache.config import DEFAULTS, TtlPlan, TtlPolicy
from prefixcache.cache.isolation import prefetch, remove_in_slices
from prefixcache.cache.keys import BlockHash, Hasher, Namespace, block_keys, pack_tokens, sha256_hasher
from prefixcache.cache.pins import PinnedPrefixes
from prefixcache.cache.reasons import Explainer, Walk
from prefixcache.cache.request import CommitResult, Match
from prefixcache.cache.stats import CacheStats, Outcome, TenantCounters, cache_stats
from prefixcache.cache.store import Block, BlockStore, Chain, PayloadFn, Run
from prefixcache.cache.tiers.base import Tier
from prefixcache.cache.tiers.codec import BlockLayout
from prefixcache.cache.tiers.stack import TierStack

__all__ = ["CommitResult", "Match", "PayloadFn", "PrefixCache", "Tier"]


class PrefixCache:
    """Exact prefix cache: chained block keys over a :class:`BlockStore`, with tiers below it."""

    def __init__(
        self,
        *,
        block_size: int = DEFAULTS.block_size,
        capacity_bytes: int = DEFAULTS.capacity_bytes,
        pinned_capacity_bytes: int = DEFAULTS.pinned_capacity_bytes,
        default_ttl_s: float = DEFAULTS.default_ttl_s,
        clock: Clock | None = None,
        hasher: Hasher | None = None,
        reasons_bytes: int = 0,
        explain: bool = True,
    ) -> None:
        """``reasons_bytes``: memory for explaining misses (the ghost record of removed blocks and
        each tenant's recent prompts), taken out of ``capacity_bytes``; 0 keeps neither (a miss
        is then told apart only as ``diverged`` inside a live run, ``new_prefix`` or the rest).
        ``explain`` False: no reason at all (``Match.reason`` None; a benchmark's baseline)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        if reasons_bytes < 0 or (reasons_bytes and reasons_bytes >= capacity_bytes):
            raise ValueError(
                f"reasons_bytes ({reasons_bytes}) must be >= 0 and below capacity_bytes ({capacity_bytes})"
            )
        self.block_size = block_size
        self.clock = clock or monotonic
        self.hasher = hasher or sha256_hasher
        self.policy = TtlPolicy(default_ttl_s=default_ttl_s)
        self.store = BlockStore(capacity_bytes - reasons_bytes, pinned_capacity_bytes, clock=self.clock)
        self.reasons_bytes = reasons_bytes
        self.explain = explain
        # Half the reasons' budget remembers removed blocks, half the tenants' recent prompts.
        self._explainer = Explainer(reasons_bytes, self.clock, block_size)
        self.ghosts, self.recent = self._explainer.ghosts, self._explainer.recent  # (None: no budget)
        if self.ghosts is not None:
            self.store.add_removal_listener(self.ghosts.on_removal)
        self._tier_stack = TierStack(self.store)
        self.tiers: list[Tier] = self._tier_stack.tiers  # in lookup order; add with add_tier
        #: The one lock every method takes; a caller holding it sees the cache stand still.
        self.lock = threading.RLock()
        # Traffic counters per tenant; the totals are their sum (one count per request, not two).
        self._tenants: dict[str, TenantCounters] = {}
        self._pins = PinnedPrefixes(self.store)
        #: Set by an engine with a KV pool: turns a payload promoted from a tier into the
        #: engine's own kind (a pool block). None keeps tier payloads as they come.
        self.adopt: Callable[[Any], Any] | None = None
        #: True: a match continues in the tiers under the lock (their I/O inside it). An engine
        #: sets False and calls :meth:`prefetch` on the request's thread before admission.
        self.promote_in_match = True

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
        align, chain = self._prepare(tokens, ns, align_tokens, ttl_s, ttl_plan, keys, packed)
        prompt_tokens = len(chain.packed) >> 2
        with self.lock:
            usable, outcome, held, _, walk = self._begin(chain, prompt_tokens, align)
            reason = None
            if self.explain:
                unavailable = bool(self.tiers) and self._tier_stack.unavailable
                reason = self._explainer.explain(
                    chain, align, usable, walk, now=self.clock(), tier_unavailable=unavailable
                )
            return Match(
                namespace=ns,
                prompt_tokens=prompt_tokens,
                keys=chain.keys,
                ttls=chain.ttls,
                packed=chain.packed,
                block_size=self.block_size,
                outcome=Outcome(outcome),
                cached_blocks=usable,
                reason=reason,
                _cache=self,
                _held=held,
                _depth=usable,
            )

    def prefetch(
        self,
        tokens: Sequence[int] | None,
        ns: Namespace,
        *,
        align_tokens: int | None = None,
        ttl_s: float | None = None,
        ttl_plan: TtlPlan | None = None,
        keys: list[BlockHash] | None = None,
        packed: bytes | None = None,
    ) -> int:
        """Read this prompt's blocks that memory lacks from the tiers without holding the lock,
        and insert them (arguments: :meth:`match`'s). See :func:`~prefixcache.cache.isolation.prefetch`."""
        if not self._tier_stack.tiers:
            return 0
        align, chain = self._prepare(tokens, ns, align_tokens, ttl_s, ttl_plan, keys, packed)
        return prefetch(self.lock, self.store, self._tier_stack, chain, align=align, adopt=self.adopt)

    def cached_prefix(self, keys: list[BlockHash], packed: bytes) -> int:
        """Blocks of this prompt that a request would find cached now (live, verified), without
        touching anything: what a cache-aware router asks each replica."""
        with self.lock:
            return self.store.lookup(keys, packed, len(keys))[0]

    def commit(
        self,
        m: Match,
        payload_fn: PayloadFn | None,
        *,
        upto_tokens: int | None = None,
        uniform_nbytes: int | None = None,
    ) -> CommitResult:
        """Store the prompt's full blocks after the cached prefix that are not cached yet.

        ``upto_tokens`` stops at the block that ends there (the engine commits only blocks of
        complete prefill chunks). Blocks already present (computed by another request
        meanwhile, or beyond an alignment cut) are kept and acquired, not rewritten. New blocks
        are acquired into ``m``. ``uniform_nbytes``: the caller promises every payload has this
        size (a simulator); room for a run of new blocks is then made in one pass (same victims).
        ``payload_fn`` None (with ``uniform_nbytes``): every payload is None.
        """
        if m.released:
            raise RuntimeError("commit after release: the match no longer holds its prefix")
        block_size = self.block_size
        keys, ns = m.keys, m.namespace
        stop = len(keys) if upto_tokens is None else min(len(keys), max(upto_tokens, 0) // block_size)
        chain = Chain.of(
            keys=keys, packed=m.packed, step=4 * block_size, namespace=ns.root, tenant=ns.tenant, ttls=m.ttls
        )
        with self.lock:
            start = m._depth
            reached, ranges, short, m._held = self.store.write_chain(
                chain, start, stop, m._held, payload_fn, uniform_nbytes
            )
            for first, count in ranges:
                m.written_keys.extend(keys[first : first + count])
            if short:
                m.skipped_blocks = stop - reached
            m._depth = reached
            written = self._written(self._tenants[ns.tenant], keys, reached, ranges)
        return CommitResult(written, written * block_size, m.skipped_blocks)

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
        """One whole request for a simulator: what ``m = match(None, ns, keys=keys, packed=packed,
        ...)``, ``commit(m, None, uniform_nbytes=nbytes, upto_tokens=...)`` and ``release(m)`` do,
        with payloads None, through the same steps minus the :class:`Match` (a simulator replays
        millions). Returns (cached tokens, written tokens)."""
        block_size = self.block_size
        align = align_tokens or block_size
        if align % block_size or len(keys) != len(packed) // (4 * block_size):
            self._prepare(None, ns, align_tokens, ttl_s, None, keys, packed)  # raises what match raises
        ttls = self.policy.block_ttls(len(keys), block_size, ttl_s)
        chain = Chain.of(
            keys=keys, packed=packed, step=4 * block_size, namespace=ns.root, tenant=ns.tenant, ttls=ttls
        )
        stop = len(keys) if upto_tokens is None else min(len(keys), max(upto_tokens, 0) // block_size)
        store = self.store
        with self.lock:
            usable, _, held, counters, _ = self._begin(chain, len(packed) >> 2, align)
            reached, ranges, _, held = store.write_chain(chain, usable, stop, held, None, nbytes)
            written = self._written(counters, keys, reached, ranges) if ranges else 0
            if held is not None:
                store.release(held)
        return usable * block_size, written * block_size

    def release(self, m: Match) -> None:
        """Drop every reference ``m`` holds. Idempotent; call it in a finally."""
        with self.lock:
            if m.released:
                return
            m.released = True
            if m._held is not None:
                self.store.release(m._held)
                m._held = None

    # ------------------------------------------------------------------ the steps of a request
    def _prepare(
        self,
        tokens: Sequence[int] | None,
        ns: Namespace,
        align_tokens: int | None,
        ttl_s: float | None,
        ttl_plan: TtlPlan | None,
        keys: list[BlockHash] | None,
        packed: bytes | None,
    ) -> tuple[int, Chain]:
        """Check a request and complete what the caller did not compute: (alignment in tokens,
        the prompt's chain: keys, packed tokens, the TTL asked for each full block). Raises
        ValueError."""
        block_size = self.block_size
        align = align_tokens or block_size
        if align % block_size:
            raise ValueError(f"align_tokens ({align}) must be a multiple of block_size ({block_size})")
        if packed is None:
            if tokens is None:
                raise ValueError("match needs tokens or packed")
            packed = pack_tokens(tokens)
        full_blocks = len(packed) // (4 * block_size)
        if keys is None:
            keys = block_keys(None, ns, block_size, self.hasher, packed=packed)
        elif len(keys) != full_blocks:
            raise ValueError(f"keys has {len(keys)} entries; the prompt has {full_blocks} full blocks")
        ttls = self.policy.block_ttls(len(keys), block_size, ttl_s, ttl_plan)
        step = 4 * block_size
        return align, Chain.of(
            keys=keys, packed=packed, step=step, namespace=ns.root, tenant=ns.tenant, ttls=ttls
        )

    def _begin(
        self, chain: Chain, prompt_tokens: int, align: int
    ) -> tuple[int, str, Run | None, TenantCounters, Walk]:
        """Match's work, under the lock: expire what is due, find the usable cached prefix (the
        tiers continue it), hold and refresh its deepest block, count the request. Returns
        (usable blocks, the outcome's value, the run held or None, the tenant's counters, the
        walk: blocks found, the segments of memory's walk, blocks the request may read)."""
        block_size = self.block_size
        keys, packed = chain.keys, chain.packed
        # Cap: at least one token is computed (there must be logits to sample from), and a hit
        # ends on an alignment boundary (the prefill chunk schedule makes that exact).
        max_blocks = (max(prompt_tokens - 1, 0) // align) * align // block_size
        store = self.store
        store.sweep()
        found, segments = store.lookup(keys, packed, max_blocks)
        promoted = 0
        if found < max_blocks and self.tiers and self.promote_in_match:
            promoted = self._tier_stack.promote(chain, found, max_blocks, self.adopt)
            found += promoted
        usable = (found * block_size // align) * align // block_size
        held = None
        outcome = "miss"
        if usable:
            if promoted:
                held = store.hold_chain(chain, 0, usable)  # (the store walks the chain)
            else:
                run, first, _ = segments[-1]  # the hit's deepest block is most often in the last segment
                if usable - 1 - run.depth < first:
                    run = run_of(segments, usable - 1)
                held = store.hold_chain(chain, 0, usable, run)
            outcome = "hit" if usable == max_blocks else "partial"
        counters = self._tenants.get(chain.tenant)
        if counters is None:
            counters = self._tenants[chain.tenant] = TenantCounters()
        counters.count(prompt_tokens, usable * block_size, outcome)
        return usable, outcome, held, counters, (found, segments, max_blocks)

    def _written(
        self, counters: TenantCounters, keys: list[BlockHash], reached: int, ranges: list[tuple[int, int]]
    ) -> int:
        """Count the blocks a commit wrote (``ranges`` of the chain ``keys[:reached]``) on the
        tenant's ``counters`` and write them through to the tiers. Returns how many."""
        written = 0
        for _, count in ranges:
            written += count
        counters.written_tokens += written * self.block_size
        if written and self.tiers:
            self._tier_stack.write_through(keys, reached, ranges)
        return written

    # ------------------------------------------------------------------ keep-warm and admin
    def pin(self, tokens: Sequence[int], ns: Namespace, *, keys: list[BlockHash] | None = None) -> int:
        """Pin the cached full blocks of this prefix (no expiry, no eviction). Returns the
        pinned token count (0 when nothing is cached yet: prefill it first). ``keys``: the
        prefix's block keys where the caller made them (as for :meth:`match`). Raises
        :class:`~prefixcache.cache.store.PinBudgetExceeded`, pinning nothing."""
        keys = self.block_keys(tokens, ns) if keys is None else keys
        packed = pack_tokens(tokens)
        with self.lock:
            return self._pins.pin(keys, packed, ns.root) * self.block_size

    def unpin(self, tokens: Sequence[int], ns: Namespace) -> int:
        """Undo :meth:`pin` for every pinned prefix of ``tokens``. Returns tokens unpinned."""
        keys = self.block_keys(tokens, ns)
        with self.lock:
            return self._pins.unpin(keys, ns.root) * self.block_size

    def limit_tenant_pins(self, share: float) -> None:
        """Let one tenant pin at most ``share`` (0 < share <= 1) of the pinned budget: beyond,
        :meth:`pin` raises :class:`~prefixcache.cache.pins.TenantPinBudgetExceeded`."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"the tenant pin share must be in (0, 1]; got {share}")
        with self.lock:
            self._pins.tenant_share = share

    def limit_tenant_capacity(self, share: float | None) -> None:
        """Over ``share`` (0 < share <= 1) of the capacity, a tenant's inserts evict its own
        leaves first (:mod:`~prefixcache.cache.shares`); None: one LRU over every tenant."""
        with self.lock:
            self.store.set_tenant_share(share)

    def pinned_prefixes(self) -> int:
        with self.lock:
            return len(self._pins)

    def pinned_blocks(self) -> list[Block]:
        """Snapshots of every pinned block (O(blocks held): for periodic keep-warm work)."""
        with self.lock:
            return [block for block in self.store if block.pin_count > 0]

    def flush(self, ns: Namespace) -> int:
        """Remove every unreferenced, unpinned block of this namespace from memory. Returns
        blocks removed. The lock is taken a slice of runs at a time (``isolation.SLICE_RUNS``), so
        other requests interleave with a large flush. :meth:`remove_tier_entries`: the tiers."""
        root = ns.root
        return remove_in_slices(self.lock, self.store, lambda run: run.namespace == root, "flush")

    def remove_tier_entries(self, ns: Namespace) -> dict[str, int]:
        """Delete this namespace's entries from every tier (disk, Redis): {tier name: entries
        removed}. Tier I/O runs outside the cache's lock; blocks written after it starts stay."""
        return self._tier_stack.remove_namespace(ns.root)

    def invalidate(self, ns: Namespace, keys: Sequence[BlockHash]) -> tuple[int, int]:
        """Remove the blocks ``keys`` of namespace ``ns`` and every block cached after them (a
        child's KV was computed from its parent's) from memory, as the exactness audit does with
        blocks found to differ from a recomputation. A run is removed whole (its earlier blocks
        are recomputed, never served wrong). Blocks a running request reads, or pinned, stay.
        Returns (blocks removed, blocks of ``keys`` still stored)."""
        bad = set(keys)
        root = ns.root

        def affected(run: Run) -> bool:
            if run.namespace != root:
                return False
            node: Run | None = run
            while node is not None:
                if not bad.isdisjoint(node.keys):
                    return True
                node = node.up
            return False

        with self.lock:
            removed = self.store.remove_where(affected, reason="verify")
            left = len(self.store.snapshots(list(keys), missing_ok=True))
        return removed, left

    def remove_tier_keys(self, ns: Namespace, keys: Sequence[BlockHash]) -> dict[str, int]:
        """Delete the entries ``keys`` of namespace ``ns`` from every tier that can remove single
        entries: {tier name: entries removed}. Tier I/O: call it without holding the cache's lock."""
        return self._tier_stack.remove_keys(ns.root, [bytes(k) for k in keys])

    def set_block_layout(self, layout: BlockLayout | None) -> None:
        """The shape and dtype every payload promoted from a tier must have (an engine sets its
        KV pool's block layout); an entry of another layout is a counted corrupt miss."""
        with self.lock:
            self._tier_stack.layout = layout

    def sweep(self) -> int:
        with self.lock:
            return self.store.sweep()

    def add_tier(self, tier: Tier) -> None:
        """Add ``tier`` below memory and the tiers added before it (see ``prefixcache.cache.tiers``)."""
        with self.lock:
            self._tier_stack.add(tier)

    def snapshots(self, keys: Sequence[BlockHash], *, missing_ok: bool = False) -> list[Block]:
        """Snapshots of the stored blocks ``keys`` (a chain from depth 0, or any keys with
        ``missing_ok``, which skips those no longer stored)."""
        with self.lock:
            return self.store.snapshots(keys, missing_ok=missing_ok)

    def stats(self, tenant: str | None = None) -> CacheStats:
        """Traffic counters (one tenant's, or every tenant's summed) and what is held for them."""
        with self.lock:
            return cache_stats(self._tenants, self.store, self._tier_stack.promoted_blocks, tenant)

    def check_integrity(self) -> None:
        """Assert every invariant of the store and of the pinned prefixes (O(n): tests)."""
        with self.lock:
            self.store.check_integrity()
            self._pins.check()
