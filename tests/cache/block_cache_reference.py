"""Reference model for the differential tests: the PrefixCache of prefixcache 0.1.0 over the
block-per-object store in ``block_store_reference.py`` (verbatim apart from this line, its imports,
the Match's ``held`` and ``depth``, once ``_held`` and ``_depth``, and ``_lookup`` reading ``store.get``).

PrefixCache: the request-facing API over the block store.

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

from block_store_reference import Block, BlockStore

from prefixcache.cache.clock import Clock, monotonic
from prefixcache.cache.config import TtlPlan, TtlPolicy
from prefixcache.cache.keys import BlockHash, Hasher, Namespace, block_keys, pack_tokens, sha256_hasher
from prefixcache.cache.stats import CacheStats, Outcome, RequestUsage, TenantCounters

#: block index -> (payload, nbytes); called only for blocks actually stored.
PayloadFn = Callable[[int], tuple[Any, int]]


class Tier(Protocol):
    """A store below memory (disk, Redis) under the same keys. See ``prefixcache.cache.tiers``."""

    name: str
    #: True: every committed block is written at once (shared tiers); False: on eviction only.
    write_through: bool

    def get_many(
        self, keys: Sequence[BlockHash], tokens: Sequence[bytes], namespace: bytes, layout: Any = None
    ) -> list[tuple[Any, int]]:
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
    blocks: list[Block]  # the cached prefix, in order
    ttls: list[float]  # the TTL each full block is stored or refreshed with
    packed: bytes = field(repr=False)
    block_size: int = 16
    outcome: Outcome = Outcome.MISS
    written: list[Block] = field(default_factory=list)
    skipped_blocks: int = 0
    released: bool = False
    held: Block | None = field(default=None, repr=False)  # the deepest block, referenced
    depth: int = 0  # blocks of the prompt covered by held's chain

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def usage(self) -> RequestUsage:
        return RequestUsage(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            cache_write_tokens=len(self.written) * self.block_size,
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
        self.store.add_listener(self._on_store_event)

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
        tokens: Sequence[int],
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
        simulator replaying millions of requests hashes each shared prefix once.
        """
        n = len(tokens)
        B = self.block_size
        align = align_tokens or B
        if align % B:
            raise ValueError(f"align_tokens ({align}) must be a multiple of block_size ({B})")
        if packed is None:
            packed = pack_tokens(tokens)
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
            hits = self._lookup(keys, packed, max_blocks)
            # Only a leaf can be due (ancestors' freshness is their subtree's), so one check.
            if hits and store.is_due(hits[-1], self.clock()):
                hits.pop()
            if len(hits) < max_blocks and self.tiers:
                hits.extend(self._promote(keys, packed, len(hits), max_blocks, ns, ttls))
            usable = (len(hits) * B // align) * align // B
            hits = hits[:usable]
            m = Match(namespace=ns, prompt_tokens=n, keys=keys, blocks=hits, ttls=ttls, packed=packed, block_size=B)
            if hits:
                self._hold(m, hits, ttls)
                m.depth = len(hits)
            if not hits:
                m.outcome = Outcome.MISS
            elif usable == max_blocks:
                m.outcome = Outcome.HIT
            else:
                m.outcome = Outcome.PARTIAL
            usage = RequestUsage(prompt_tokens=n, cached_tokens=usable * B)
            self._totals.add(usage, m.outcome)
            self._tenants.setdefault(ns.tenant, TenantCounters()).add(usage, m.outcome)
        return m

    def _lookup(self, keys: list[BlockHash], packed: bytes, max_blocks: int) -> list[Block]:
        """The cached blocks of the longest run of leading ``keys``, verified.

        Tokens (and parents) are compared so that even a hash collision cannot serve another
        prompt's state. Done in bulk, in C, for the common case; block by block only to find
        where a collision cuts the run.
        """
        store = self.store
        step = 4 * self.block_size
        found = list(map(store.get, keys[:max_blocks]))
        if None in found:
            del found[found.index(None) :]
        if not found:
            return found
        n = len(found)
        if (
            b"".join([b.tokens for b in found]) == packed[: n * step]
            and found[0].parent is None
            and [b.parent for b in found[1:]] == keys[: n - 1]
        ):
            return found
        parent: BlockHash | None = None
        for i, block in enumerate(found):
            if block.tokens != packed[i * step : (i + 1) * step] or block.parent != parent:
                store.counters.collisions += 1
                return found[:i]
            parent = block.key
        return found  # pragma: no cover - the bulk check failed, so some block differs

    def _hold(self, m: Match, chain: list[Block], ttls: list[float]) -> None:
        """Make ``chain[-1]`` the one block ``m`` holds, refreshed; raise TTL classes on the way.

        Holding the deepest block protects the whole chain (ancestors have a child, so they
        are never evicted or expired), and refreshing it refreshes them: O(1) per request
        instead of O(prefix), except where a longer TTL class is asked for.
        """
        store = self.store
        tail = chain[-1]
        store.acquire(tail)
        if m.held is not None:
            store.release(m.held)
        m.held = tail
        # A block keeps the longest TTL it was asked for; ttls never grow along a chain.
        if max(ttls[: len(chain)]) > min([b.ttl_s for b in chain]):  # rare: a longer class asked
            for block, ttl in zip(chain, ttls, strict=False):
                if ttl > block.ttl_s:
                    store.raise_ttl(block, ttl)
        store.touch(tail, ttls[len(chain) - 1])

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
        step = 4 * B
        ns = m.namespace
        keys = m.keys if upto_tokens is None else m.keys[: max(upto_tokens, 0) // B]
        with self._lock:
            start = m.depth
            parent: BlockHash | None = keys[start - 1] if start else None
            written: list[Block] = []
            chain: list[Block] = []
            i = start
            while i < len(keys):
                block = self.store.get(keys[i])
                if block is not None:
                    if block.tokens != m.packed[i * step : (i + 1) * step] or block.parent != parent:
                        self.store.counters.collisions += 1
                        break  # a collision: the chain cannot continue under this key
                    chain.append(block)
                    parent = keys[i]
                    i += 1
                    continue
                # A run of new blocks, inserted in one call (same effect as one insert each).
                new, no_room = self.store.insert_chain(
                    keys, parent, m.packed, i, step, payload_fn, namespace=ns.root, tenant=ns.tenant, ttls=m.ttls,
                    uniform_nbytes=uniform_nbytes,
                )
                written.extend(new)
                chain.extend(new)
                i += len(new)
                if no_room or not new:
                    m.skipped_blocks = len(keys) - i
                    break
                parent = keys[i - 1]
            if chain:
                self._hold(m, chain, m.ttls[start : start + len(chain)])
                m.depth = start + len(chain)
            m.written.extend(written)
            tokens_written = len(written) * B
            self._totals.written_tokens += tokens_written
            self._tenants.setdefault(ns.tenant, TenantCounters()).written_tokens += tokens_written
            for tier in self.tiers:
                if tier.write_through:
                    for block in written:
                        tier.put(block)
        return CommitResult(len(written), tokens_written, m.skipped_blocks)

    def release(self, m: Match) -> None:
        """Drop every reference ``m`` holds. Idempotent; call it in a finally."""
        with self._lock:
            if m.released:
                return
            m.released = True
            if m.held is not None:
                self.store.release(m.held)
                m.held = None

    # ------------------------------------------------------------------ keep-warm and admin
    def pin(self, tokens: Sequence[int], ns: Namespace) -> int:
        """Pin the cached full blocks of this prefix (no expiry, no eviction). Returns the
        pinned token count (0 when nothing is cached yet: prefill it first)."""
        keys = self.block_keys(tokens, ns)
        packed = pack_tokens(tokens)
        step = 4 * self.block_size
        with self._lock:
            chain: list[Block] = []
            parent: BlockHash | None = None
            for i, key in enumerate(keys):
                block = self.store.lookup(key, packed[i * step : (i + 1) * step], parent)
                if block is None:
                    break
                chain.append(block)
                parent = key
            if not chain:
                return 0
            pin_id = (ns.root, chain[-1].key)
            if pin_id in self._pins:
                return len(chain) * self.block_size
            done: list[Block] = []
            try:
                for block in chain:
                    self.store.pin(block)
                    done.append(block)
            except BaseException:
                for block in reversed(done):
                    self.store.unpin(block)
                raise
            self._pins[pin_id] = [b.key for b in chain]
            return len(chain) * self.block_size

    def unpin(self, tokens: Sequence[int], ns: Namespace) -> int:
        """Undo :meth:`pin` for every pinned prefix of ``tokens``. Returns tokens unpinned."""
        keys = set(self.block_keys(tokens, ns))
        unpinned = 0
        with self._lock:
            for pin_id in [p for p in self._pins if p[0] == ns.root and p[1] in keys]:
                chain = self._pins.pop(pin_id)
                for key in reversed(chain):
                    block = self.store.get(key)
                    if block is not None:
                        self.store.unpin(block)
                unpinned = max(unpinned, len(chain) * self.block_size)
        return unpinned

    def pinned_prefixes(self) -> int:
        with self._lock:
            return len(self._pins)

    def flush(self, ns: Namespace) -> int:
        """Remove every unreferenced, unpinned block of this namespace. Returns blocks removed."""
        with self._lock:
            return self.store.remove_where(lambda b: b.namespace == ns.root, reason="flush")

    def sweep(self) -> int:
        with self._lock:
            return self.store.sweep()

    def add_tier(self, tier: Tier) -> None:
        with self._lock:
            self.tiers.append(tier)

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
                    block = self.store.get(key)
                    assert block is not None and block.pin_count > 0, "a pinned prefix lost a block"

    # ------------------------------------------------------------------ tiers
    def _promote(
        self, keys: list[BlockHash], packed: bytes, start: int, stop: int, ns: Namespace, ttls: list[float]
    ) -> list[Block]:
        """Bring the run of blocks ``start..stop`` up from the tiers into memory."""
        step = 4 * self.block_size
        promoted: list[Block] = []
        i = start
        for tier in self.tiers:
            if i >= stop:
                break
            base = i
            tokens = [packed[j * step : (j + 1) * step] for j in range(base, stop)]
            for payload, nbytes in tier.get_many(keys[base:stop], tokens, ns.root):
                parent = keys[i - 1] if i else None
                block = self.store.insert(
                    keys[i], parent, tokens[i - base], payload, nbytes,
                    namespace=ns.root, tenant=ns.tenant, ttl_s=ttls[i],
                )
                if block is None:
                    break
                promoted.append(block)
                i += 1
        self._tier_hits += len(promoted)
        return promoted

    def _on_store_event(self, event: str, block: Block) -> None:
        if event == "evict" and block.evicted_reason == "capacity":
            for tier in self.tiers:
                if not tier.write_through:
                    tier.put(block)
