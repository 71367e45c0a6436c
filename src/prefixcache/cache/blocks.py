"""The cache's data types below the manager: :class:`Block` snapshots, :class:`Run` records and
the :class:`Chain` a request writes.

A :class:`Run` is the unit the store keeps (see :mod:`~prefixcache.cache.runs`); a :class:`Block`
is what callers see of one block of a run, built on demand and never updated. A :class:`Chain`
names what every write of a prompt's blocks passes down (keys, tokens, namespace, tenant, TTLs),
field by field, so that no call can swap two of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.keys import BlockHash

#: One segment of a stored chain: (run, position of the chain's first block in it, block count).
Segment = tuple["Run", int, int]


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


class Run:
    """A chain of blocks (see the module docstring). ``keys[i]`` holds
    ``packed[i*step:(i+1)*step]``, ``payloads[i]`` and ``sizes[i]`` bytes, at depth ``depth + i``.
    ``ref_count``, ``last_used`` and ``n_children`` are the last block's; ``ttl_s``, ``pin_count``,
    ``namespace`` and ``tenant`` are every block's. A dropped run has no keys."""

    __slots__ = (
        "keys",
        "packed",
        "payloads",
        "sizes",
        "nbytes",
        "unit",
        "step",
        "depth",
        "parent",
        "up",
        "namespace",
        "tenant",
        "ttl_s",
        "last_used",
        "ref_count",
        "pin_count",
        "n_children",
    )

    def __init__(
        self,
        keys: list[BlockHash],
        packed: bytes,
        payloads: list[Any],
        sizes: list[int],
        unit: int,
        depth: int,
        parent: BlockHash | None,
        namespace: bytes,
        tenant: str,
        ttl_s: float,
        last_used: float,
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

    def block(self, offset: int, reason: str | None = None) -> Block:
        """A snapshot of the block at ``offset`` in this run."""
        is_tail = offset == len(self.keys) - 1
        step = self.step
        return Block(
            key=self.keys[offset],
            parent=self.keys[offset - 1] if offset else self.parent,
            tokens=self.packed[offset * step : (offset + 1) * step],
            payload=self.payloads[offset],
            nbytes=self.sizes[offset],
            namespace=self.namespace,
            tenant=self.tenant,
            depth=self.depth + offset,
            ttl_s=self.ttl_s,
            expires_at=self.last_used + self.ttl_s,
            last_used=self.last_used,
            ref_count=self.ref_count if is_tail else 0,
            pin_count=self.pin_count,
            n_children=self.n_children if is_tail else 1,
            evicted_reason=reason,
        )


_new = object.__new__


@dataclass(slots=True, kw_only=True, eq=False)
class Chain:
    """One prompt's chain of blocks as the store and the tiers write it: block ``j`` has the key
    ``keys[j]``, holds the tokens ``packed[j*step:(j+1)*step]`` and is stored (or refreshed) with
    the TTL class ``ttls[j]``, for the namespace root ``namespace`` and ``tenant``. Built once per
    request and never changed (not frozen: a simulator builds millions)."""

    keys: list[BlockHash]
    packed: bytes
    step: int  # bytes of packed tokens per block (4 x block size)
    namespace: bytes
    tenant: str
    ttls: list[float]

    @classmethod
    def of(
        cls,
        *,
        keys: list[BlockHash],
        packed: bytes,
        step: int,
        namespace: bytes,
        tenant: str,
        ttls: list[float],
    ) -> Chain:
        """``Chain(keys=..., ...)`` at half the cost: a class called with keywords gathers them in
        a dict first, a method does not (the manager makes one chain per request)."""
        chain = _new(cls)
        chain.keys, chain.packed, chain.step = keys, packed, step
        chain.namespace, chain.tenant, chain.ttls = namespace, tenant, ttls
        return chain


@dataclass(slots=True)
class StoreCounters:
    """What the store counts besides what it holds (read by ``PrefixCache.stats``)."""

    evictions: dict[str, int] = field(default_factory=lambda: {"capacity": 0, "ttl": 0, "flush": 0})
    collisions: int = 0  # a key matched but its tokens, parent or depth did not
    rejected: int = 0  # inserts refused for lack of room


def expires(run: Run) -> float:
    """When ``run``'s tail expires (a leaf's expiry is always its last use plus its TTL)."""
    return run.last_used + run.ttl_s


def run_of(segments: list[Segment], index: int) -> Run:
    """The run holding block ``index`` among a walk's segments."""
    for run, offset, _ in reversed(segments):
        if run.depth + offset <= index:
            return run
    raise IndexError(index)
