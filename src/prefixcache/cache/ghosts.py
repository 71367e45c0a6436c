"""What the cache remembers to explain a miss, in a fixed byte budget: recently removed blocks
(*ghosts*: which key left, why and when) and each namespace's recent prompts.

Both records are bounded by bytes (oldest entries go first) and both are keyed by namespace, so an
explanation looks only at the caller's own cache. :class:`GhostRecord` is fed by the store's
removal listener (``BlockStore.add_removal_listener``): every removed block, with its reason
("ttl", "capacity", "flush"), costs one dictionary entry. :class:`RecentPrompts` is fed by
``PrefixCache.match`` and holds references to the packed prompts the cache already built (no copy).

The budget is taken out of the cache's byte budget by :class:`~prefixcache.cache.manager.PrefixCache`
(``reasons_bytes``), so the memory that explains misses is counted like the blocks themselves.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from prefixcache.cache.clock import Clock
from prefixcache.cache.keys import BlockHash

__all__ = ["GHOST_ENTRY_BYTES", "PROMPT_ENTRY_BYTES", "Ghost", "GhostRecord", "RecentPrompts"]

#: What one ghost costs, measured with tracemalloc (key bytes, the Ghost, its two floats and the
#: ordered dict's entry come to about 300 bytes; tests/cache/test_reasons.py holds the record to it).
GHOST_ENTRY_BYTES = 320
#: A recent prompt's cost besides its packed tokens (the ordered dicts' entries and the tuple key).
PROMPT_ENTRY_BYTES = 256


class Ghost(NamedTuple):
    """A removed block: why ("ttl", "capacity", "flush"), when, when it was due to expire, and
    its namespace root (a lookup checks it: only the caller's own ghosts explain its miss)."""

    reason: str
    removed_at: float
    expires_at: float
    namespace: bytes


class GhostRecord:
    """The last ``max_bytes // GHOST_ENTRY_BYTES`` blocks removed from the store, by key.

    Not thread-safe: the cache's lock covers it (the store calls the listener under it)."""

    def __init__(self, max_bytes: int, clock: Clock) -> None:
        self.max_entries = max(int(max_bytes), 0) // GHOST_ENTRY_BYTES
        self.clock = clock
        self._ghosts: OrderedDict[BlockHash, Ghost] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ghosts)

    @property
    def nbytes(self) -> int:
        """The record's estimated size now (at most ``max_entries * GHOST_ENTRY_BYTES``)."""
        return len(self._ghosts) * GHOST_ENTRY_BYTES

    def on_removal(self, keys: list[BlockHash], namespace: bytes, reason: str, expires_at: float) -> None:
        """The store's removal listener: remember the blocks removed together, under one
        :class:`Ghost` (a key stored again is found live before its ghost is ever consulted)."""
        if not self.max_entries:
            return
        ghost = Ghost(reason, self.clock(), expires_at, namespace)
        ghosts = self._ghosts
        for key in keys:
            ghosts[key] = ghost
            ghosts.move_to_end(key)
        while len(ghosts) > self.max_entries:
            ghosts.popitem(last=False)

    def get(self, key: BlockHash, namespace: bytes) -> Ghost | None:
        """The ghost of ``key`` if it belongs to ``namespace``, else None."""
        ghost = self._ghosts.get(key)
        return ghost if ghost is not None and ghost.namespace == namespace else None


class RecentPrompts:
    """The last ``per_namespace`` distinct prompts of each namespace (packed tokens), at most
    ``max_bytes`` in all (the oldest prompt of any namespace goes first). A prompt is known by
    the key of its last full block (the chain names every full block before it: no hashing of
    the prompt), so prompts that differ only after it count as one, the newest kept. Not
    thread-safe."""

    def __init__(self, max_bytes: int, per_namespace: int = 8) -> None:
        self.max_bytes = max(int(max_bytes), 0)
        self.per_namespace = per_namespace
        self.nbytes = 0
        # (namespace, last key) -> packed, oldest first; and each namespace's last keys
        self._all: OrderedDict[tuple[bytes, BlockHash], bytes] = OrderedDict()
        self._by_namespace: dict[bytes, OrderedDict[BlockHash, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def add(self, namespace: bytes, last_key: BlockHash, packed: bytes) -> None:
        """Remember ``packed`` (a reference: bytes are immutable), whose last full block has the
        key ``last_key``, as the namespace's newest prompt."""
        cost = len(packed) + PROMPT_ENTRY_BYTES
        if cost > self.max_bytes:
            return
        entry = (namespace, last_key)
        prompts = self._by_namespace.get(namespace)
        if prompts is None:
            prompts = self._by_namespace[namespace] = OrderedDict()
        previous = self._all.get(entry)
        if previous is not None:
            prompts.move_to_end(last_key)
            self._all.move_to_end(entry)
            self._all[entry] = packed
            self.nbytes += len(packed) - len(previous)
        else:
            prompts[last_key] = None
            self._all[entry] = packed
            self.nbytes += cost
            if len(prompts) > self.per_namespace:
                self._forget((namespace, next(iter(prompts))))
        while self.nbytes > self.max_bytes:
            self._forget(next(iter(self._all)))

    def _forget(self, entry: tuple[bytes, BlockHash]) -> None:
        namespace, last_key = entry
        packed = self._all.pop(entry)
        prompts = self._by_namespace[namespace]
        del prompts[last_key]
        if not prompts:
            del self._by_namespace[namespace]
        self.nbytes -= len(packed) + PROMPT_ENTRY_BYTES

    def of(self, namespace: bytes) -> list[bytes]:
        """The namespace's recent prompts, newest first (only the caller's namespace is ever read)."""
        prompts = self._by_namespace.get(namespace)
        if not prompts:
            return []
        return [self._all[(namespace, key)] for key in reversed(prompts)]
