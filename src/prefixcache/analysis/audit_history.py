"""What the audit's scan remembers of earlier requests, and how it stays small and fast.

* :class:`SeenPrefixes`: every key seen, without writing every key of every request. The keys a
  request adds form one *run*, hung under the run and position of the request's deepest shared
  key (keys carry their namespace, so one structure serves every tenant). Only a run's first key
  and its keys at depths S-1, 2S-1, ... (S = :data:`INDEX_EVERY`) are indexed: a binary search
  over those depths brackets a shared prefix within S blocks, and a walk along the runs settles
  it. A run's last-use times are a staircase (times shrink along a chain), and a request
  rewrites only the staircases of the few runs its shared prefix passes through.
* :class:`EndpointHistory`: per (endpoint, run), a staircase of which request of the endpoint
  first reached each run position.
* :class:`PrefixVersions`: each endpoint's stable depth, fixed from its first requests, and the
  distinct keys at that depth (prefix versions).

A set of chains is prefix-closed, so "block j is present" is monotone in j: what the binary
search relies on. Positions and runs are plain ints; ``run << 32 | position`` packs one place.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

INDEX_EVERY = 8  # a run's keys are indexed at every 8th depth (and its first key)
KEY_BYTES = 16  # bytes per fingerprint key
STABLE_PROBE_REQUESTS = 200  # an endpoint's stable depth is fixed from this many first requests
_LOW32 = 0xFFFFFFFF  # the position half of ``run << 32 | position``

#: A request's shared prefix as the (run, position) of its deepest key in each run it passes
#: through, deepest first.
RunPath = list[tuple[int, int]]


@dataclass(slots=True)
class PrefixVersion:
    """One prefix version of an endpoint: the requests whose key at the stable depth is the same."""

    first_ts: float
    last_ts: float
    requests: int = 1


class SeenPrefixes:
    """Every key of every earlier request, as runs (see the module docstring), with last-use times.

    Run ``r``'s keys are ``run_keys[r]`` (joined: one object per run, not one per key, ~1.3 GB at
    10^6 requests); ``run_parent[r]`` is ``run << 32 | position`` of the key it hangs under (-1 at
    depth 0); its last-use staircase is ``run_ends[r]`` / ``run_last_use[r]``: piece p covers
    positions ``[ends[p-1], ends[p])``. ``index`` maps an indexed key to ``run << 32 | position``.
    """

    __slots__ = ("index", "run_keys", "run_parent", "run_ends", "run_last_use", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.index: dict[bytes, int] = {}
        self.run_keys: list[bytes] = []
        self.run_parent: list[int] = []
        self.run_ends: list[list[int]] = []
        self.run_last_use: list[list[float]] = []

    def longest_prefix(self, keys: list[bytes]) -> tuple[int, int, int]:
        """(blocks of ``keys`` some earlier request had, run, position of the deepest of them);
        (0, -1, -1) when none. Reads only."""
        index, every, run_keys, width = self.index, INDEX_EVERY, self.run_keys, KEY_BYTES
        n_keys = len(keys)
        # Binary search over the indexed depths every-1, 2*every-1, ...: how many are present.
        lo, hi = 0, n_keys // every
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if keys[mid * every - 1] in index:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            depth = lo * every - 1
            code = index[keys[depth]]
            run, position = code >> 32, code & _LOW32
            depth += 1
        else:
            depth, run, position = 0, -1, -1
        # Then walk at most ``every`` blocks: along the run, or into a run that starts there (a key
        # that is not a run's first continues its parent's run).
        while depth < n_keys:
            key = keys[depth]
            if run >= 0:
                joined = run_keys[run]
                start = (position + 1) * width
                if start < len(joined) and joined[start : start + width] == key:
                    position += 1
                    depth += 1
                    continue
            code = index.get(key)
            if code is None or code & _LOW32:
                break
            run, position = code >> 32, 0
            depth += 1
        return depth, run, position

    def touch(self, shared: int, run: int, position: int, now: float) -> tuple[RunPath, float, int]:
        """Use the first ``shared`` blocks (ending at ``run``, ``position``) at ``now``: returns the
        path of (run, position) it passes, deepest first; the seconds since its deepest block was
        last used; and how many of its blocks were used within the TTL. Sets their last use to now.
        (Fresh: last use + TTL > now, the store's own test, in the same floating-point terms.)"""
        ttl = self.ttl_s
        ends_of, last_use_of, parent_of = self.run_ends, self.run_last_use, self.run_parent
        gap = now - last_use_of[run][bisect_right(ends_of[run], position)]
        path = []
        fresh = -1
        depth = shared - 1  # of the block at (run, position)
        while depth >= 0:
            path.append((run, position))
            ends = ends_of[run]
            times = last_use_of[run]
            if fresh < 0 and times[0] + ttl > now:  # the freshest piece is this run's first
                piece = bisect_right(ends, position)
                if times[piece] + ttl > now:
                    fresh = depth + 1
                else:
                    piece = 0
                    while times[piece + 1] + ttl > now:
                        piece += 1
                    fresh = depth - position + ends[piece]
            # Positions [0, position] now share one time, ``now``: the pieces that ended within
            # them become one new first piece.
            cut = bisect_right(ends, position + 1)
            ends[:cut] = (position + 1,)
            times[:cut] = (now,)
            depth -= position + 1
            code = parent_of[run]
            run, position = code >> 32, code & _LOW32
        return path, gap, (fresh if fresh > 0 else 0)

    def add_run(self, keys: list[bytes], shared: int, parent: tuple[int, int] | None, now: float) -> int:
        """Store ``keys[shared:]`` as a new run under ``parent`` (run, position; None at depth 0),
        used at ``now``. Returns the run's id."""
        run = len(self.run_keys)
        self.run_parent.append(parent[0] << 32 | parent[1] if parent is not None else -1)
        self.run_keys.append(b"".join(keys[shared:]))
        self.run_ends.append([len(keys) - shared])
        self.run_last_use.append([now])
        index = self.index
        index[keys[shared]] = run << 32
        every = INDEX_EVERY
        first_indexed = shared + every - 1 - shared % every  # the first of every-1, 2*every-1, ... >= shared
        for depth in range(first_indexed, len(keys), every):
            index[keys[depth]] = run << 32 | (depth - shared)
        return run


class EndpointHistory:
    """Which request of each endpoint first reached each run position.

    ``stairs[endpoint << 40 | run]`` is a staircase (ends, requests): ``requests[p]`` is the first
    request of the endpoint at run positions ``[ends[p-1], ends[p])``; its last end is how far into
    the run the endpoint has been (a prefix: keys chain). ``first_request[e]``: the endpoint's first
    request, -1 until it has one.
    """

    __slots__ = ("stairs", "first_request")

    def __init__(self) -> None:
        self.stairs: dict[int, tuple[list[int], list[int]]] = {}
        self.first_request: list[int] = []

    def add_endpoint(self) -> None:
        self.first_request.append(-1)

    def closest_earlier(self, endpoint: int, path: RunPath, request: int) -> tuple[int, int]:
        """(blocks ``request`` shares with the endpoint's earlier requests, the first of them to
        share that many: the endpoint's first request when none shares a block, -1 when there is
        none). ``path``: the request's shared prefix as :meth:`SeenPrefixes.touch` returned it.
        Records ``request`` wherever it goes further than the endpoint had been."""
        stairs = self.stairs
        base = endpoint << 40
        depth = 0
        reference = self.first_request[endpoint]
        remaining = len(path)  # path[:remaining] is still to walk; the walk goes from the root down
        while remaining:
            remaining -= 1
            run, position = path[remaining]
            stair = stairs.get(base | run)
            if stair is None:
                remaining += 1
                break
            ends, requests = stair
            reach = ends[-1]
            if reach > position:
                depth += position + 1
                reference = requests[bisect_right(ends, position)]
                continue
            depth += reach
            reference = requests[-1]
            ends.append(position + 1)
            requests.append(request)
            break
        while remaining:  # the rest of the path is new to the endpoint
            remaining -= 1
            run, position = path[remaining]
            stairs[base | run] = ([position + 1], [request])
        if reference < 0:
            self.first_request[endpoint] = request
        return depth, reference

    def add_run(self, endpoint: int, run: int, length: int, request: int) -> None:
        """``request`` of ``endpoint`` wrote the new ``run`` (of ``length`` keys)."""
        self.stairs[endpoint << 40 | run] = ([length], [request])


class PrefixVersions:
    """Per endpoint: the stable depth (the ``quantile`` percentile of the endpoint depths of its
    first :data:`STABLE_PROBE_REQUESTS` requests, 0 when none shared), then one
    :class:`PrefixVersion` per distinct key at that depth."""

    __slots__ = ("quantile", "stable", "versions", "probes")

    def __init__(self, quantile: float) -> None:
        self.quantile = quantile
        self.stable: list[int | None] = []  # None: still probing
        self.versions: list[dict[bytes, PrefixVersion]] = []
        self.probes: list[list[tuple[list[bytes], int, float]]] = []  # (keys, endpoint depth, ts)

    def add_endpoint(self) -> None:
        self.stable.append(None)
        self.versions.append({})
        self.probes.append([])

    def observe(self, endpoint: int, keys: list[bytes], depth: int, ts: float) -> None:
        """A request of ``endpoint`` with its keys and endpoint depth (requests in time order)."""
        stable = self.stable[endpoint]
        if stable is None:
            probes = self.probes[endpoint]
            probes.append((keys, depth, ts))
            if len(probes) >= STABLE_PROBE_REQUESTS:
                self._fix_stable(endpoint)
        elif stable and len(keys) >= stable:  # :meth:`_count`, inline: this runs once per request
            versions = self.versions[endpoint]
            version = versions.get(keys[stable - 1])
            if version is None:
                versions[keys[stable - 1]] = PrefixVersion(ts, ts)
            else:
                version.last_ts = ts
                version.requests += 1

    def finish(self) -> tuple[list[int], list[dict[bytes, PrefixVersion]]]:
        """Fix the endpoints still probing; returns (stable depth, versions) per endpoint."""
        for endpoint, stable in enumerate(self.stable):
            if stable is None:
                self._fix_stable(endpoint)
        return [s or 0 for s in self.stable], self.versions

    def _count(self, endpoint: int, key: bytes, ts: float) -> None:
        version = self.versions[endpoint].get(key)
        if version is None:
            self.versions[endpoint][key] = PrefixVersion(ts, ts)
        else:
            version.last_ts = ts
            version.requests += 1

    def _fix_stable(self, endpoint: int) -> None:
        probes = self.probes[endpoint]
        depths = [depth for _, depth, _ in probes if depth > 0]
        stable = int(np.percentile(depths, self.quantile, method="lower")) if depths else 0
        self.stable[endpoint] = stable
        for keys, _, ts in probes:
            if stable and len(keys) >= stable:
                self._count(endpoint, keys[stable - 1], ts)
        self.probes[endpoint] = []
