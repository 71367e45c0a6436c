"""Why a request's cache read ended where it did: one :class:`Reason` per request, and the tokens
that would have been read had that not happened.

:func:`classify` is a pure function of what ``PrefixCache.match`` found: the prompt's keys and
tokens, how far the verified walk got (``found``), how much of it the request may read
(``max_blocks``: every full block but the one holding the last prompt token, rounded down to the
alignment), the live run the walk stopped inside (if any), the ghost record and the namespace's
recent prompts. It never touches the store; it reads only the caller's namespace.

The reasons, checked in this order for the first block ``n`` the walk did not find:

* ``below_minimum``: the prompt has no block it could read (``max_blocks == 0``);
* ``full_hit``: every block it could read was read (``usable == max_blocks``);
* ``tier_unavailable``: a tier below memory failed or was switched off by its breaker during
  this lookup;
* ``expired`` / ``evicted`` / ``flushed``: block ``n`` was cached for this namespace and removed
  (TTL, capacity, flush), as the ghost record remembers;
* ``diverged``: a cached (or recent) prompt of this namespace shares the blocks read and holds
  other tokens in block ``n``: ``token_index`` is the first token where the prompt leaves it;
* ``new_prefix``: nothing cached, removed or recent continues the prefix read (a new prompt, or
  a new turn after the cached ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from prefixcache.cache.blocks import Chain, Segment
from prefixcache.cache.clock import Clock
from prefixcache.cache.ghosts import GhostRecord, RecentPrompts
from prefixcache.cache.keys import BlockHash, unpack_tokens

__all__ = [
    "CONTEXT_TOKENS",
    "CacheReason",
    "Continuation",
    "Explainer",
    "Reason",
    "Walk",
    "classify",
    "continuation_of",
    "missed_tokens",
    "readable_tokens",
]

#: Tokens kept on each side of a divergence (the server decodes them).
CONTEXT_TOKENS = 8


class Reason(StrEnum):
    FULL_HIT = "full_hit"
    NEW_PREFIX = "new_prefix"
    DIVERGED = "diverged"
    EXPIRED = "expired"
    EVICTED = "evicted"
    FLUSHED = "flushed"
    BELOW_MINIMUM = "below_minimum"
    TIER_UNAVAILABLE = "tier_unavailable"


def readable_tokens(prompt_tokens: int, block_size: int, align: int | None = None) -> int:
    """Tokens of a prompt a cache read may return: its full blocks but the one holding the last
    prompt token (always computed), rounded down to the hit alignment (``align`` tokens)."""
    per_align = max((align or block_size) // block_size, 1)
    return max(prompt_tokens - 1, 0) // block_size // per_align * per_align * block_size


def missed_tokens(
    other_tokens: int, prompt_tokens: int, cached_tokens: int, block_size: int, align: int | None = None
) -> int:
    """``cache_missed_tokens`` of a request that left a cached prompt of ``other_tokens`` tokens
    (docs/server.md): the readable tokens the two prompts could have shared (the fewer of
    theirs) less the ``cached_tokens`` the request read. The same figure for the ``prefixcache``
    object and Anthropic's ``cache_missed_input_tokens``."""
    shared = min(
        readable_tokens(other_tokens, block_size, align), readable_tokens(prompt_tokens, block_size, align)
    )
    return max(shared - cached_tokens, 0)


#: A ghost's removal reason -> the request's reason.
_REMOVED = {"ttl": Reason.EXPIRED, "capacity": Reason.EVICTED, "flush": Reason.FLUSHED}


@dataclass(frozen=True, slots=True)
class CacheReason:
    """Why the read ended where it did. ``cache_missed_tokens``: tokens that would have been
    read had that not happened (0 for ``full_hit``, ``new_prefix`` and ``below_minimum``).
    ``token_index`` (``diverged``): the prompt's first token that differs from the nearest cached
    prompt; ``before`` the tokens just before it, ``prompt_after`` / ``cached_after`` each side's
    tokens from it. ``cached_span``: the cached side's tokens from the start of the divergence's
    block through the last full block holding ``cached_after`` (what a caller must have written
    itself to be shown ``cached_after``: the server checks its block key). ``cached_hidden``: the
    server withheld ``cached_after`` (another credential's prompt). ``ago_s``: seconds since
    the block expired (``expired``) or was removed (``evicted``, ``flushed``)."""

    reason: Reason
    cache_missed_tokens: int = 0
    token_index: int | None = None
    before: tuple[int, ...] = ()
    prompt_after: tuple[int, ...] = ()
    cached_after: tuple[int, ...] = ()
    ago_s: float | None = None
    cached_span: tuple[int, ...] = field(default=(), repr=False)
    cached_hidden: bool = False


#: What a match's walk found: (blocks found, memory's segments, blocks the request may read).
Walk = tuple[int, list[Segment], int]

#: The live run a walk stopped inside: (its packed tokens from block ``n`` on, its blocks from ``n`` on).
Continuation = tuple[bytes, int]


def continuation_of(segments: list[Segment], found: int) -> Continuation | None:
    """The live run a walk of ``found`` blocks stopped inside, from block ``found`` on, or None
    (the walk ended at a run's last block, or found nothing). ``segments``: the walk's. Holding
    the hit may have split the last run since; a split keeps a run's tail, so that object still
    holds the walk's deepest blocks and what follows them."""
    if not segments:
        return None
    run = segments[-1][0]
    if run.keys and run.depth <= found < run.depth + len(run.keys):
        at = found - run.depth
        return run.packed[at * run.step :], len(run.keys) - at
    return None


def classify(
    *,
    keys: list[BlockHash],
    packed: bytes,
    block_size: int,
    align: int,
    found: int,
    usable: int,
    max_blocks: int,
    namespace: bytes,
    now: float,
    continuation: Continuation | None = None,
    ghosts: GhostRecord | None = None,
    recent: RecentPrompts | None = None,
    tier_unavailable: bool = False,
) -> CacheReason:
    """The reason for one match (see the module docstring). ``found``: leading blocks found
    (memory and tiers); ``usable``: those read (aligned); ``max_blocks``: those it may read."""
    if max_blocks <= 0:
        return CacheReason(Reason.BELOW_MINIMUM)
    if usable >= max_blocks:
        return CacheReason(Reason.FULL_HIT)
    step = 4 * block_size
    per_align = align // block_size

    def missed(would_read: int) -> int:
        """Tokens beyond the read had ``would_read`` leading blocks been found (aligned, capped)."""
        reachable = min(would_read, max_blocks) // per_align * per_align
        return max(reachable - usable, 0) * block_size

    n = found
    if ghosts is not None:
        ghost = ghosts.get(keys[n], namespace)
        if ghost is not None:
            end = n + 1
            while end < max_blocks and ghosts.get(keys[end], namespace) is not None:
                end += 1
            reason = _REMOVED.get(ghost.reason, Reason.EVICTED)
            ago = now - (ghost.expires_at if reason is Reason.EXPIRED else ghost.removed_at)
            if tier_unavailable:
                reason = Reason.TIER_UNAVAILABLE
            return CacheReason(reason, missed(end), ago_s=max(ago, 0.0))
    if tier_unavailable:
        return CacheReason(Reason.TIER_UNAVAILABLE)
    # The nearest cached prompt: the live run the walk stopped inside, or a recent prompt of this
    # namespace that shares the blocks read; the one that agrees longest within block n wins.
    best_index, best_other, best_blocks = -1, b"", 0
    ours = packed[n * step : (n + 1) * step]
    if continuation is not None:
        tail, blocks = continuation
        index = _first_difference(ours, tail[:step])
        if index is not None:
            best_index, best_other, best_blocks = n * block_size + index, tail, n + blocks
    if recent is not None:
        head = packed[: n * step]
        for other in recent.of(namespace):
            # (a prompt whose last block is partial counts too: the edit may fall in that block)
            if len(other) <= n * step or not other.startswith(head):
                continue
            index = _first_difference(ours, other[n * step : (n + 1) * step])
            # (at an equal divergence the recent prompt wins: it is the whole cached prompt, where
            # the live run may be only its first prefill chunk's blocks)
            if index is not None and n * block_size + index >= best_index:
                best_index, best_other = n * block_size + index, other[n * step :]
                best_blocks = max(len(other) // 4 - 1, 0) // block_size  # its readable blocks
    if best_index < 0:
        return CacheReason(Reason.NEW_PREFIX)
    t = best_index
    within = (t - n * block_size) * 4  # the divergence's byte offset in both tails
    shown = best_other[within : within + CONTEXT_TOKENS * 4]
    # The cached side's full blocks from block n on, as far as the shown tokens reach.
    blocks = min(-(-(within + len(shown)) // step), len(best_other) // step)
    return CacheReason(
        Reason.DIVERGED,
        missed(best_blocks),
        token_index=t,
        before=tuple(unpack_tokens(packed[max(t - CONTEXT_TOKENS, 0) * 4 : t * 4])),
        prompt_after=tuple(unpack_tokens(packed[t * 4 : (t + CONTEXT_TOKENS) * 4])),
        cached_after=tuple(unpack_tokens(shown)),
        cached_span=tuple(unpack_tokens(best_other[: blocks * step])),
    )


class Explainer:
    """What a cache keeps to explain its misses, and the explaining: within ``nbytes``, half for
    the ghost record of removed blocks (:attr:`ghosts`), half for each namespace's recent prompts
    (:attr:`recent`); 0 keeps neither (a miss is then told apart only as ``diverged`` inside a
    live run, ``new_prefix`` or the rest). ``clock``: the ghost record's. Not thread-safe: the
    cache calls it under its lock (and feeds ``ghosts.on_removal`` the store's removals)."""

    def __init__(self, nbytes: int, clock: Clock, block_size: int) -> None:
        self.block_size = block_size
        self.ghosts: GhostRecord | None = None
        self.recent: RecentPrompts | None = None
        if nbytes:
            self.ghosts = GhostRecord(nbytes // 2, clock)
            self.recent = RecentPrompts(nbytes - nbytes // 2)

    def explain(
        self, chain: Chain, align: int, usable: int, walk: Walk, *, now: float, tier_unavailable: bool
    ) -> CacheReason:
        """Why a read of ``chain`` that found ``walk`` and read ``usable`` blocks ended there
        (:func:`classify`); then remember the prompt among its namespace's recent ones."""
        found, segments, max_blocks = walk
        keys, packed = chain.keys, chain.packed
        reason = classify(
            keys=keys,
            packed=packed,
            block_size=self.block_size,
            align=align,
            found=found,
            usable=usable,
            max_blocks=max_blocks,
            namespace=chain.namespace,
            now=now,
            continuation=continuation_of(segments, found),
            ghosts=self.ghosts,
            recent=self.recent,
            tier_unavailable=tier_unavailable,
        )
        if self.recent is not None and keys:
            self.recent.add(chain.namespace, keys[-1], packed)
        return reason


def _first_difference(ours: bytes, other: bytes) -> int | None:
    """The first token (4 bytes each) where two blocks of packed tokens differ, or None when
    they agree where both have tokens (a collision, an uncached copy of the same block, or one
    a prefix of the other: no divergence to report). Either may be a partial block."""
    if ours == other:
        return None
    for index in range(0, min(len(ours), len(other)), 4):
        if ours[index : index + 4] != other[index : index + 4]:
            return index // 4
    return None
