"""The audit's one pass over a trace: per request, three prefix depths, a reuse gap, the most
similar earlier request of its endpoint and the first token that differs from it.

* achievable: the longest prefix any earlier request of the same tenant had (unbounded cache,
  no TTL);
* within TTL: the part of that prefix used within the last TTL seconds (what expiry leaves),
  which is, request for request, the hit an unbounded PrefixCache with that TTL gives;
* endpoint depth: the longest prefix shared with an earlier request of the same endpoint, and
  the first of those requests to share it (the reference the divergence is measured against,
  refined to the first differing token, which lies in the next block).

What the pass remembers of earlier requests is in :mod:`~prefixcache.analysis.audit_history`;
work per request is O(new blocks) plus O(log blocks) lookups and O(runs on its shared prefix),
never proportional to the cache or trace size. The keys are the feed's fingerprints, not
SHA-256: these keys only ever meet each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from prefixcache.analysis.audit_history import (
    EndpointHistory,
    PrefixVersion,
    PrefixVersions,
    RunPath,
    SeenPrefixes,
)
from prefixcache.analysis.feed import TraceFeed
from prefixcache.analysis.trace import TOKEN_DTYPE


@dataclass(slots=True)
class ScanResult:
    """Per-request columns (int64 tokens unless said) and per-endpoint prefix versions."""

    achievable: np.ndarray
    within_ttl: np.ndarray
    diverge: np.ndarray  # first differing token vs ``reference`` (-1: no earlier request)
    reference: np.ndarray  # the most similar earlier request of the endpoint (-1: none)
    gap_s: np.ndarray  # float64: seconds since the shared prefix was last used (NaN: none shared)
    stable_blocks: list[int]  # per endpoint: the depth its prefix versions are told apart at
    versions: list[dict[bytes, PrefixVersion]]  # per endpoint: key at the stable depth -> version


def scan(
    feed: TraceFeed,
    *,
    block_size: int,
    align_tokens: int | None,
    ttl_s: float,
    stable_quantile: float,
    progress: Callable[[str, int], None] | None = None,
) -> ScanResult:
    """The pass over ``feed`` (iterated to its end; its keys made with ``block_size``). Hits end on
    a multiple of ``align_tokens`` (None: the block size) and leave one prompt token to compute,
    as the cache's; a block is fresh while last use + ``ttl_s`` > now. ``stable_quantile``: see
    :class:`PrefixVersions`. ``progress("scan", i)`` every 5,000 requests."""
    return _Scan(feed, block_size, align_tokens or block_size, ttl_s, stable_quantile).run(progress)


class _Scan:
    """One pass: what it remembers (:mod:`~prefixcache.analysis.audit_history`), the result
    columns, and the loop that drives them."""

    _SLAB = 1 << 16  # result columns grow a slab at a time (a stream's length is known at its end)

    def __init__(
        self, feed: TraceFeed, block_size: int, align: int, ttl_s: float, stable_quantile: float
    ) -> None:
        self.feed = feed
        self.block_size = block_size
        self.align = align
        self.seen = SeenPrefixes(ttl_s)
        self.history = EndpointHistory()
        self.versions = PrefixVersions(stable_quantile)
        self.windows = _Windows(feed)
        self.achievable: list[int] = []
        self.within_ttl: list[int] = []
        self.diverge: list[int] = []
        self.reference: list[int] = []
        self.gap_s: list[float] = []

    def run(self, progress: Callable[[str, int], None] | None) -> ScanResult:
        """Every request of the feed, in order; then the columns (see :meth:`_result`)."""
        feed = self.feed
        ts, endpoint_of, prompt_tokens = feed.ts, feed.endpoint, feed.prompt_tokens
        achievable, within_ttl, gap_s = self.achievable, self.within_ttl, self.gap_s
        diverge, reference_of, first_diff = self.diverge, self.reference, self.windows.diverge
        longest_prefix, touch, add_run = self.seen.longest_prefix, self.seen.touch, self.seen.add_run
        closest_earlier, note_new_run = self.history.closest_earlier, self.history.add_run
        observe_version = self.versions.observe
        block, align = self.block_size, self.align
        room = endpoints = 0
        for i, keys in enumerate(feed):
            if i == room:
                room = self._grow()
            now = ts[i]
            endpoint = endpoint_of[i]
            if endpoint >= endpoints:
                endpoints = self._add_endpoints(endpoints, endpoint)
            shared, deepest_run, deepest_position = longest_prefix(keys)
            path: RunPath = []
            # (Conditional expressions, not min(): a builtin call costs more, 10^6 times.)
            if shared:
                path, gap_s[i], fresh = touch(shared, deepest_run, deepest_position, now)
                # Blocks a hit may cover: it leaves one token to compute and ends aligned (a
                # shared block means the prompt has at least one token).
                cap = ((prompt_tokens[i] - 1) // align) * align // block
                within_ttl[i] = ((fresh if fresh < cap else cap) * block // align) * align
                achievable[i] = ((shared if shared < cap else cap) * block // align) * align
            depth, reference = closest_earlier(endpoint, path, i)
            if shared < len(keys):
                new_run = add_run(keys, shared, path[0] if shared else None, now)
                note_new_run(endpoint, new_run, len(keys) - shared, i)
            if reference >= 0:
                reference_of[i] = reference
                n_tokens, reference_tokens = prompt_tokens[i], prompt_tokens[reference]
                shorter = n_tokens if n_tokens < reference_tokens else reference_tokens
                diverge[i] = first_diff(i, reference, depth * block, shorter, block)
            observe_version(endpoint, keys, depth, now)
            if progress is not None and i % 5000 == 0:
                progress("scan", i)
        return self._result(len(feed.ts))

    def _grow(self) -> int:
        """One more slab of every column, at its default; returns the new length."""
        slab = self._SLAB
        for column, default in (
            (self.achievable, 0),
            (self.within_ttl, 0),
            (self.diverge, -1),
            (self.reference, -1),
            (self.gap_s, float("nan")),
        ):
            column.extend([default] * slab)
        return len(self.achievable)

    def _add_endpoints(self, known: int, endpoint: int) -> int:
        """Endpoints appear as the feed goes: room for ids ``known..endpoint``; returns how many."""
        for _ in range(known, endpoint + 1):
            self.history.add_endpoint()
            self.versions.add_endpoint()
        return endpoint + 1

    def _result(self, n: int) -> ScanResult:
        stable, versions = self.versions.finish()
        return ScanResult(
            achievable=np.array(self.achievable[:n], dtype=np.int64),
            within_ttl=np.array(self.within_ttl[:n], dtype=np.int64),
            diverge=np.array(self.diverge[:n], dtype=np.int64),
            reference=np.array(self.reference[:n], dtype=np.int64),
            gap_s=np.array(self.gap_s[:n], dtype=np.float64),
            stable_blocks=stable,
            versions=versions,
        )


class _Windows:
    """Windows of prompts' packed tokens, sliced from segments kept as bytes (a bounded cache,
    emptied when full: slicing bytes costs a fraction of slicing an array and packing it)."""

    def __init__(self, feed: TraceFeed, budget: int = 1 << 28) -> None:
        self.feed = feed
        self.segments = feed.segments  # (the feed's lists, which grow in place)
        self.seg_len = feed.seg_len
        self.packed = feed.seg_bytes  # streams: every segment already packed (no cache needed)
        self.token_bytes = np.dtype(TOKEN_DTYPE).itemsize
        self.cache: dict[int, bytes] = {}
        self.cached_bytes = 0
        self.budget = budget

    def window(self, parts: tuple[int, ...], lo: int, hi: int) -> bytes:
        """Tokens ``[lo, hi)`` of the prompt ``parts``, packed, without assembling the prompt."""
        offset = 0
        out = b""
        width, cache, seg_len, packed = self.token_bytes, self.cache, self.seg_len, self.packed
        for segment in parts:
            end = offset + seg_len[segment]
            if end > lo:
                data = packed[segment] if packed is not None else cache.get(segment)
                if data is None:
                    data = self.segments[segment].tobytes()
                    if self.cached_bytes + len(data) > self.budget:
                        cache.clear()
                        self.cached_bytes = 0
                    cache[segment] = data
                    self.cached_bytes += len(data)
                piece = data[max(lo - offset, 0) * width : (hi - offset) * width]
                if end >= hi:
                    return out + piece if out else piece
                out += piece
            offset = end
        return out

    def diverge(self, request: int, reference: int, start: int, shorter: int, block: int) -> int:
        """``_first_diff(tokens(request), tokens(reference), start)`` for requests that share
        exactly ``start // block`` blocks: their first difference is within the next block (else
        that block would be shared too) or at ``shorter``, the shorter prompt's length, so only
        that window is compared."""
        hi = min(start + block, shorter)
        if hi > start:
            parts = self.feed.parts
            a = self.window(parts[request], start, hi)
            b = self.window(parts[reference], start, hi)
            if a != b:
                # Little-endian: the lowest set bit of the XOR lies in the first differing token.
                x = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
                return start + ((x & -x).bit_length() - 1) // (8 * self.token_bytes)
        if hi == shorter:
            return shorter
        # Equal keys, unequal tokens (a key collision): compare the whole prompts.
        return _first_diff(self.feed.tokens(request), self.feed.tokens(reference), start)  # pragma: no cover


def _first_diff(a: np.ndarray, b: np.ndarray, start: int) -> int:
    """First index >= start where a and b differ (equal before start), or the shorter length."""
    n = min(len(a), len(b))
    s = min(start, n)
    neq = np.flatnonzero(a[s:n] != b[s:n])
    return s + int(neq[0]) if len(neq) else n
