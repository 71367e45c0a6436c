"""Why a trace's hit rate is what it is: busting spans, prefix stability, TTL versus traffic.

One pass over the trace (a :class:`~prefixcache.analysis.feed.TraceFeed`: the requests in time
order with their chained block keys, fingerprints computed in batches, shared segments hashed
once) computes three prefix depths per request (a set of chains is prefix-closed, so "block j is
present" is monotone in j):

* achievable: the longest prefix any earlier request of the same tenant had (unbounded cache,
  no TTL);
* within TTL: the part of that prefix used within the last TTL seconds (what expiry leaves);
* endpoint divergence: the longest prefix shared with an earlier request of the same endpoint,
  refined to the first differing token against that request (which lies in the next block).

The keys a request adds are kept as one run, under the run and position of its deepest shared
key; last-use times and each endpoint's first requests are staircases per run, and only a sparse
index of keys is hashed (see ``_scan``). Work per request is O(new blocks) plus O(log blocks)
lookups and O(runs on its shared prefix): never proportional to the cache or trace size.

The achieved hit rate comes from the trace's ``cached_tokens`` when every line has it. Else it is
what the real PrefixCache serves with unbounded capacity and the given TTL, and the scan already
has it: the within-TTL depth is, request for request, the hit such a cache gives (a block lives
while something in its subtree was used within the TTL, and a hit is capped and aligned the same
way). ``tests/analysis/test_audit.py`` holds the two equal against a replay through the real
PrefixCache (:func:`~prefixcache.analysis.simulate.simulate`) over TTLs, alignments and block
sizes. A trace whose requests ask for their own TTL (``ttl``: TTL classes, which the scan does not
model) is replayed; from 20,000 requests on that replay runs in a forked child process while the
scan runs (it sends back only the cached-token array), where fork exists. ``always_replay``
replays in every case.

:func:`audit_file` streams: a reader process parses the file and computes the keys once, and
sends them to the scan (this process), and to the replay child when there is one, as it reads,
so reading, scanning and replaying overlap (see :mod:`~prefixcache.analysis.feed`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.costs import pricing_profile
from prefixcache.analysis.feed import TraceFeed, TraceUnsorted, can_stream, stream
from prefixcache.analysis.keychains import paused_gc
from prefixcache.analysis.simulate import SimConfig, simulate
from prefixcache.analysis.spans import Pair, find_busting
from prefixcache.analysis.trace import (
    TOKEN_DTYPE,
    Trace,
    TraceFormatError,
    iter_lines,
    load_tokenizer,
    load_trace,
)
from prefixcache.cache import model_fingerprint

log = logging.getLogger(__name__)

_INDEX_EVERY = 8  # the audit indexes a run's keys at every 8th depth (and its first key)


@dataclass(slots=True)
class AuditConfig:
    ttl_s: float = 300.0
    block_size: int = 16
    align_tokens: int | None = None
    min_shared_tokens: int = 64  # a busting span must sit above this much shared content
    sample_pairs: int = 48  # pairs per endpoint examined for busting spans
    pricing: str = "anthropic"
    tokenizer: str | None = None  # overrides the trace header's
    stable_quantile: float = 10.0  # percentile of shared depth taken as an endpoint's stable prefix
    version_min_share: float = 0.01  # a prefix version must serve this share of requests (and 2)
    fingerprint: str = model_fingerprint("audit", "float32", 16)
    replay: bool = True  # False: achieved = the trace's cached_tokens (0 where absent), nothing derived
    always_replay: bool = False  # replay through PrefixCache even where the scan gives the same hits


@dataclass(slots=True)
class AuditResult:
    """Per-request arrays (for plots) and the per-endpoint findings (``endpoints``)."""

    config: AuditConfig
    ts: np.ndarray
    endpoint: np.ndarray
    prompt_tokens: np.ndarray
    achieved: np.ndarray  # cached tokens (trace or replay)
    achievable: np.ndarray
    diverge: np.ndarray  # first differing token vs the most similar earlier request (-1: none)
    gap_s: np.ndarray  # seconds since the achievable prefix was last used (NaN: no prefix)
    endpoints: list[dict[str, Any]]
    endpoint_names: list[str]
    achieved_source: str
    hit_rate: float = 0.0
    achievable_hit_rate: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": len(self.ts),
            "ttl_s": self.config.ttl_s,
            "block_size": self.config.block_size,
            "hit_rate": self.hit_rate,
            "achievable_hit_rate": self.achievable_hit_rate,
            "achieved_source": self.achieved_source,
            "endpoints": self.endpoints,
            "notes": self.notes,
        }


def audit(trace: Trace, cfg: AuditConfig, *, progress: Callable[[str, int], None] | None = None) -> AuditResult:
    """Audit ``trace`` (contract in the module docstring). ``progress(stage, done)`` reports."""
    replay = _needs_replay(cfg, bool(trace.has_cached.all()), bool(np.isfinite(trace.ttl_s).any()))
    feed = TraceFeed.of(trace, cfg.fingerprint, cfg.block_size)
    # The replay runs beside the scan, in a forked child, when the trace is big enough to pay for it.
    child = _ReplayChild.start(trace, cfg) if replay and len(trace) >= _FORK_MIN_REQUESTS else None
    try:
        with paused_gc():
            return _audit(feed, cfg, progress, child)
    finally:
        if child is not None:
            child.close()


def audit_file(
    path: str | Path, cfg: AuditConfig, *, tokenizer: str | None = None,
    progress: Callable[[str, float, float], None] | None = None,
) -> AuditResult:
    """:func:`audit` of a trace file. Where fork exists, a reader process parses the file and
    computes the keys (:func:`~prefixcache.analysis.feed.stream`) while this process scans and a
    second child replays, both fed as the file is read; a trace too far out of time order for
    the reader's window is loaded whole instead. ``progress(stage, done, total)``: bytes of the
    file read (streams) or requests. Raises TraceFormatError naming a bad line."""
    if can_stream():
        replay = _needs_replay(cfg, *_head(path))
        child = None
        try:
            feeds = stream(path, fingerprint=cfg.fingerprint, block_size=cfg.block_size, tokenizer=tokenizer,
                           consumers=2 if replay else 1)
            if replay:
                child = _ReplayChild.start(feeds[1], cfg, close=feeds[0])
                feeds[1].detach()
        except OSError as exc:  # pragma: no cover - out of processes
            log.warning("audit: cannot start a reader process (%s); loading the trace first", exc)
        else:
            feed = feeds[0]
            on = None
            if progress is not None:
                def on(stage: str, k: int) -> None:
                    if stage == "scan":
                        progress("reading and scanning", feed.position, feed.size)
                    else:
                        progress(stage, k, len(feed.endpoints) if stage == "endpoints" else len(feed.ts))
            try:
                with paused_gc():
                    return _audit(feed, cfg, on, child)
            except TraceUnsorted as exc:
                log.info("%s; loading and sorting the whole trace instead", exc)
            finally:
                feed.close()
                if child is not None:
                    child.close()
    trace = load_trace(path, tokenizer=tokenizer,
                       progress=(lambda k: progress("reading", k, 0)) if progress is not None else None)
    n = len(trace)
    return audit(trace, cfg, progress=(lambda stage, k: progress(
        stage, k, len(trace.endpoints) if stage == "endpoints" else n)) if progress is not None else None)


def _needs_replay(cfg: AuditConfig, all_cached: bool, own_ttls: bool) -> bool:
    """Whether the achieved hits need a replay through PrefixCache (see the module docstring)."""
    return cfg.replay and not all_cached and (own_ttls or cfg.always_replay)


def _head(path: str | Path, lines: int = 1000) -> tuple[bool, bool]:
    """From the first request lines: (every one carries ``cached_tokens``, some ask for a
    ``ttl``), to decide on a replay child before streaming. Should later lines say otherwise,
    the replay runs after the scan instead."""
    seen = 0
    all_cached, ttls = True, False
    try:
        for _, obj in iter_lines(path):
            if obj.get("type", "request") != "request":
                continue
            all_cached = all_cached and obj.get("cached_tokens") is not None
            ttls = ttls or isinstance(obj.get("ttl"), int | float)
            seen += 1
            if seen >= lines:
                break
    except TraceFormatError:
        return False, False  # the reader reports it, with its line
    return all_cached and seen > 0, ttls


def _audit(
    feed: TraceFeed, cfg: AuditConfig, progress: Callable[[str, int], None] | None, child: _ReplayChild | None
) -> AuditResult:
    ttl = cfg.ttl_s
    achievable, within_ttl, diverge, ref, gap, stable, versions = _scan(feed, cfg, progress)
    trace = feed.trace()
    if not cfg.replay or bool(trace.has_cached.all()):
        achieved, source = trace.cached_tokens.astype(np.int64), "trace cached_tokens"
    elif not _needs_replay(cfg, False, bool(np.isfinite(trace.ttl_s).any())):
        achieved = within_ttl
        source = f"PrefixCache, TTL {ttl:g} s, unbounded capacity: the scan's within-TTL hits"
    else:
        achieved = child.result() if child is not None else None
        if achieved is None:
            achieved = _replay(trace, cfg, progress)
        elif progress is not None:
            progress("replay", len(trace))
        source = f"replay through PrefixCache (TTL {ttl:g} s, unbounded capacity)"

    pricing = pricing_profile(cfg.pricing)
    tok_cache: list[Any] = []

    def tok_loader() -> Any:
        if not tok_cache:
            tok_cache.append(load_tokenizer(cfg.tokenizer or trace.tokenizer))
        return tok_cache[0]

    rows = []
    for e, name in enumerate(trace.endpoints):
        idx = np.flatnonzero(trace.endpoint == e)
        rows.append(_endpoint_row(
            trace, cfg, e, name, idx, achieved, achievable, within_ttl, diverge, ref, gap, stable[e] or 0,
            versions[e], pricing, tok_loader,
        ))
        if progress is not None:
            progress("endpoints", e + 1)
    q = int(trace.prompt_tokens.sum())
    return AuditResult(
        config=cfg, ts=trace.ts, endpoint=trace.endpoint, prompt_tokens=trace.prompt_tokens, achieved=achieved,
        achievable=achievable, diverge=diverge, gap_s=gap, endpoints=rows, endpoint_names=list(trace.endpoints),
        achieved_source=source, hit_rate=float(achieved.sum() / q) if q else 0.0,
        achievable_hit_rate=float(achievable.sum() / q) if q else 0.0,
    )


def _replay_config(cfg: AuditConfig) -> SimConfig:
    return SimConfig(ttl_s=cfg.ttl_s, capacity_bytes=1 << 62, block_size=cfg.block_size,
                     align_tokens=cfg.align_tokens, replicas=1, pricing=(), fingerprint=cfg.fingerprint)


def _replay(trace: Trace | TraceFeed, cfg: AuditConfig, progress: Callable[[str, int], None] | None) -> np.ndarray:
    """Cached tokens per request from replaying ``trace`` through the real PrefixCache."""
    on = (lambda k: progress("replay", k)) if progress is not None else None
    return simulate(trace, _replay_config(cfg), progress=on).cached.astype(np.int64, copy=False)


_FORK_MIN_REQUESTS = 20_000  # below this a fork costs more than running the replay after the scan


class _ReplayChild:
    """The replay in a forked child process; it sends back only the ``cached`` int64 array."""

    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc, self.conn = proc, conn

    @classmethod
    def start(cls, source: Trace | TraceFeed, cfg: AuditConfig, close: TraceFeed | None = None) -> _ReplayChild | None:
        """None where fork is unavailable (or fails): the caller replays in-process. ``close``:
        a feed of this process's that the child must not hold open."""
        if "fork" not in mp.get_all_start_methods():
            return None
        ctx = mp.get_context("fork")
        try:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_replay_child_main, args=(source, cfg, send, close), daemon=True)
            proc.start()
        except (OSError, AssertionError) as exc:  # pragma: no cover - out of processes; or inside a daemon process
            log.warning("audit: cannot fork the replay (%s); replaying after the scan", exc)
            return None
        send.close()
        return cls(proc, recv)

    def result(self) -> np.ndarray | None:
        """The child's array, or None (logged) if it failed."""
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            data = b""
        self.proc.join()
        if self.proc.exitcode != 0 or len(data) % 8:
            log.warning("audit: the replay child failed (exit %s); replaying in-process", self.proc.exitcode)
            return None
        return np.frombuffer(data, dtype=np.int64).copy()

    def close(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()


def _replay_child_main(source: Trace | TraceFeed, cfg: AuditConfig, conn: Any, close: TraceFeed | None) -> None:
    if close is not None:
        close.detach()
    try:
        with paused_gc():
            cached = _replay(source, cfg, None)
        conn.send_bytes(np.ascontiguousarray(cached, dtype=np.int64).tobytes())
    finally:
        conn.close()


def _scan(
    feed: TraceFeed, cfg: AuditConfig, progress: Callable[[str, int], None] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int | None], list[dict[bytes, dict[str, Any]]]]:
    """The per-request pass: achievable and within-TTL depths, reuse gaps, the most similar
    earlier request of the endpoint and the first token that differs from it, prefix versions.
    The keys are the feed's: fingerprints, not SHA-256 (these keys only ever meet each other)."""
    B = cfg.block_size
    align = cfg.align_tokens or B
    ttl = cfg.ttl_s
    ts = feed.ts
    endpoint = feed.endpoint
    ptoks = feed.prompt_tokens
    windows = _Windows(feed)
    # Every key seen, without writing every key of every request. The keys a request adds form a
    # run (``run_keys``; keys carry their namespace, so one structure serves every tenant), hung
    # under the run and position of the request's deepest shared key (``run_parent``). ``where``
    # indexes only a run's first key and its keys at depths S-1, 2S-1, ... (run << 32 | position):
    # a binary search over those depths brackets the shared prefix within S blocks, and a walk
    # along the runs settles it (a key that is not a run's first continues its parent's run).
    # A run's last-use times are a staircase (``run_ends`` / ``run_times``: piece p covers
    # positions [ends[p-1], ends[p]); times shrink along a chain), and a request rewrites only the
    # staircases of the few runs its shared prefix passes through.
    S = _INDEX_EVERY
    where: dict[bytes, int] = {}
    run_keys: list[bytes] = []  # each run's keys, joined
    run_parent: list[int] = []  # run << 32 | position of the parent key, -1 at depth 0
    run_ends: list[list[int]] = []
    run_times: list[list[float]] = []
    # Which endpoints know which keys, also by run: (run, endpoint) -> a staircase (ends, requests),
    # the first request of the endpoint at run positions [ends[p-1], ends[p]); its last end is how
    # far into the run the endpoint has been (a prefix: chains).
    # (Endpoints appear as the feed goes: the per-endpoint lists grow, and staircases are keyed
    # endpoint << 40 | run.)
    ep_stairs: dict[int, tuple[list[int], list[int]]] = {}
    ep_first_req: list[int] = []
    # Per-request results, grown a slab at a time (the feed's length is known only at its end).
    achievable: list[int] = []
    within_ttl: list[int] = []
    ep_depth: list[int] = []
    diverge: list[int] = []
    ref: list[int] = []
    nan = float("nan")
    gap: list[float] = []
    room = 0
    slab = 1 << 16
    # Versions: an endpoint's stable depth is fixed from its first requests, then each request's
    # key at that depth names its prefix version.
    probe_keys: list[list[tuple[int, list[bytes]]]] = []
    stable: list[int | None] = []
    versions: list[dict[bytes, dict[str, Any]]] = []

    def add_version(e: int, i: int, keys: list[bytes]) -> None:
        d = stable[e]
        if not d or len(keys) < d:
            return
        v = versions[e].get(keys[d - 1])
        t = ts[i]
        if v is None:
            versions[e][keys[d - 1]] = {"first_ts": t, "last_ts": t, "requests": 1}
        else:
            v["last_ts"] = t
            v["requests"] += 1

    def fix_stable(e: int) -> None:
        depths = [ep_depth[i] for i, _ in probe_keys[e] if ep_depth[i] > 0]
        stable[e] = int(np.percentile(depths, cfg.stable_quantile, method="lower")) if depths else 0
        for i, keys in probe_keys[e]:
            add_version(e, i, keys)
        probe_keys[e] = []

    kw = 16  # bytes per fingerprint key
    for i, keys in enumerate(feed):
        if i == room:
            for col, v in ((achievable, 0), (within_ttl, 0), (ep_depth, 0), (diverge, -1), (ref, -1), (gap, nan)):
                col.extend([v] * slab)
            room += slab
        t = ts[i]
        e = endpoint[i]
        if e >= len(stable):
            for _ in range(e + 1 - len(stable)):
                ep_first_req.append(-1)
                probe_keys.append([])
                stable.append(None)
                versions.append({})
        nk = len(keys)
        cap = (max(ptoks[i] - 1, 0) // align) * align // B  # blocks a hit may cover
        # m: longest prefix any earlier request of the tenant had (prefix-closed): a binary search
        # over the indexed depths, then a walk of at most S blocks.
        lo, hi = 0, nk // S  # how many of the indexed depths S-1, 2S-1, ... are present
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if keys[mid * S - 1] in where:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            j = lo * S - 1
            code = where[keys[j]]
            ru, idx = code >> 32, code & 0xFFFFFFFF
            j += 1
        else:
            j = 0
            ru = idx = -1
        while j < nk:
            k = keys[j]
            if ru >= 0:
                rk = run_keys[ru]
                a = (idx + 1) * kw
                if a < len(rk) and rk[a : a + kw] == k:
                    idx += 1
                    j += 1
                    continue
            code = where.get(k)
            if code is None or code & 0xFFFFFFFF:
                break
            ru, idx = code >> 32, 0
            j += 1
        m = j
        path = []  # (run, position) of the shared prefix's runs, deepest first
        if m:
            # Walk the shared prefix's runs from its deepest key: the gap since its last use, the
            # part of it used within the TTL, and its last use set to now. (Fresh: last use + TTL
            # > now, the store's own test, in the same floating-point terms.)
            mt = -1
            j = m - 1
            while j >= 0:
                path.append((ru, idx))
                ends = run_ends[ru]
                tms = run_times[ru]
                if j == m - 1:
                    gap[i] = t - tms[bisect_right(ends, idx)]
                if mt < 0 and tms[0] + ttl > t:
                    p = bisect_right(ends, idx)
                    if tms[p] + ttl > t:
                        mt = j + 1
                    else:
                        p = 0
                        while tms[p + 1] + ttl > t:
                            p += 1
                        mt = j - idx + ends[p]
                c = bisect_right(ends, idx + 1)
                del ends[:c]
                del tms[:c]
                ends.insert(0, idx + 1)
                tms.insert(0, t)
                j -= idx + 1
                code = run_parent[ru]
                ru, idx = code >> 32, code & 0xFFFFFFFF
            within_ttl[i] = (min(max(mt, 0), cap) * B // align) * align
            achievable[i] = (min(m, cap) * B // align) * align
        # me: the longest prefix an earlier request of the endpoint had; r: the first of them to
        # have it (the first request of the endpoint when none shares a block).
        me = 0
        r = ep_first_req[e]
        k = len(path)
        while k:
            k -= 1
            ru, idx = path[k]
            st = ep_stairs.get(e << 40 | ru)
            if st is None:
                k += 1
                break
            reach = st[0][-1]
            if reach > idx:
                me += idx + 1
                r = st[1][bisect_right(st[0], idx)]
                continue
            me += reach
            r = st[1][-1]
            st[0].append(idx + 1)
            st[1].append(i)
            break
        while k:  # the rest of the path is new to the endpoint
            k -= 1
            ru, idx = path[k]
            ep_stairs[e << 40 | ru] = ([idx + 1], [i])
        if m < nk:
            nr = len(run_keys)
            ep_stairs[e << 40 | nr] = ([nk - m], [i])
            run_parent.append(path[0][0] << 32 | path[0][1] if m else -1)
            run_keys.append(b"".join(keys[m:]))  # one object per run, not one per key (~1.3 GB at 10^6)
            run_ends.append([nk - m])
            run_times.append([t])
            where[keys[m]] = nr << 32
            for j in range(m + S - 1 - m % S if m % S != S - 1 else m, nk, S):
                where[keys[j]] = nr << 32 | (j - m)
        ep_depth[i] = me
        if r >= 0:
            ref[i] = r
            diverge[i] = windows.diverge(i, r, me * B, min(ptoks[i], ptoks[r]), B)
        else:
            ep_first_req[e] = i
        d = stable[e]
        if d is None:
            probe_keys[e].append((i, keys))
            if len(probe_keys[e]) >= 200:
                fix_stable(e)
        elif d and nk >= d:  # add_version, inline
            v = versions[e].get(keys[d - 1])
            if v is None:
                versions[e][keys[d - 1]] = {"first_ts": t, "last_ts": t, "requests": 1}
            else:
                v["last_ts"] = t
                v["requests"] += 1
        if progress is not None and i % 5000 == 0:
            progress("scan", i)
    n = len(feed.ts)
    for col in (achievable, within_ttl, ep_depth, diverge, ref, gap):
        del col[n:]
    for e in range(len(stable)):
        if stable[e] is None:
            fix_stable(e)
    return (
        np.array(achievable, dtype=np.int64), np.array(within_ttl, dtype=np.int64), np.array(diverge, dtype=np.int64),
        np.array(ref, dtype=np.int64), np.array(gap, dtype=np.float64), stable, versions,
    )


class _Windows:
    """Windows of prompts' packed tokens, sliced from segments kept as bytes (a bounded cache,
    emptied when full: slicing bytes costs a fraction of slicing an array and packing it)."""

    def __init__(self, feed: TraceFeed, budget: int = 1 << 28) -> None:
        self.feed = feed
        self.segments = feed.segments  # (the feed's lists, which grow in place)
        self.seg_len = feed.seg_len
        self.packed = feed.seg_bytes  # streams: every segment already packed (no cache needed)
        self.size = np.dtype(TOKEN_DTYPE).itemsize
        self.cache: dict[int, bytes] = {}
        self.cached = 0
        self.budget = budget

    def window(self, parts: tuple[int, ...], lo: int, hi: int) -> bytes:
        """Tokens ``[lo, hi)`` of the prompt ``parts``, packed, without assembling the prompt."""
        off = 0
        out = b""
        w = self.size
        cache = self.cache
        for s in parts:
            end = off + self.seg_len[s]
            if end > lo:
                data = self.packed[s] if self.packed is not None else cache.get(s)
                if data is None:
                    data = self.segments[s].tobytes()
                    if self.cached + len(data) > self.budget:
                        cache.clear()
                        self.cached = 0
                    cache[s] = data
                    self.cached += len(data)
                piece = data[max(lo - off, 0) * w : (hi - off) * w]
                if end >= hi:
                    return out + piece if out else piece
                out += piece
            off = end
        return out

    def diverge(self, i: int, r: int, start: int, n: int, B: int) -> int:
        """``_first_diff(trace.tokens(i), trace.tokens(r), start)`` for requests that share exactly
        ``start // B`` blocks: their first difference is within the next block (else that block
        would be shared too) or at ``n``, the shorter length, so only that window is compared."""
        hi = min(start + B, n)
        if hi > start:
            parts = self.feed.parts
            a = self.window(parts[i], start, hi)
            b = self.window(parts[r], start, hi)
            if a != b:
                x = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
                return start + ((x & -x).bit_length() - 1) // (8 * self.size)
        if hi == n:
            return n
        return _first_diff(self.feed.tokens(i), self.feed.tokens(r), start)  # pragma: no cover - a key collision


def _first_diff(a: np.ndarray, b: np.ndarray, start: int) -> int:
    """First index >= start where a and b differ (equal before start), or the shorter length."""
    n = min(len(a), len(b))
    s = min(start, n)
    neq = np.flatnonzero(a[s:n] != b[s:n])
    return s + int(neq[0]) if len(neq) else n


def _endpoint_row(
    trace: Trace, cfg: AuditConfig, e: int, name: str, idx: np.ndarray, achieved: np.ndarray,
    achievable: np.ndarray, within_ttl: np.ndarray, diverge: np.ndarray, ref: np.ndarray, gap: np.ndarray,
    stable_blocks: int, versions: dict[bytes, dict[str, Any]], pricing: Any, tok_loader: Callable[[], Any],
) -> dict[str, Any]:
    B, ttl = cfg.block_size, cfg.ttl_s
    q = int(trace.prompt_tokens[idx].sum())
    base = pricing.input_per_mtok / 1e6
    # Busting: a sample of (request, its most similar earlier request) pairs, spread over time.
    cand = idx[ref[idx] >= 0]
    pick = cand[np.linspace(0, len(cand) - 1, min(cfg.sample_pairs, len(cand))).astype(int)] if len(cand) else cand
    pairs = [Pair(int(i), float(trace.ts[i]), trace.tokens(int(i)), trace.tokens(int(ref[i])), int(diverge[i])) for i in pick]
    findings = find_busting(pairs, tok_loader, min_shared=cfg.min_shared_tokens)
    busting = [f.as_dict(len(idx), len(pairs)) for f in findings]
    for b in busting:
        b["saving_usd_if_moved_below"] = b["saving_tokens_if_moved_below"] * (pricing.write_mult - pricing.read_mult) * base
    # Prefix stability.
    min_req = max(2, int(cfg.version_min_share * len(idx)))
    vs = sorted((v for v in versions.values() if v["requests"] >= min_req), key=lambda v: v["first_ts"])
    prefix_tokens = stable_blocks * B
    on_dominant = max((v["requests"] for v in vs), default=0)
    for v in vs:
        v["share"] = v["requests"] / len(idx)
        v["change_cost_tokens"] = prefix_tokens  # one cold prefill of the new prefix per replica
        v["change_cost_usd"] = prefix_tokens * pricing.write_mult * base
    # TTL versus traffic.
    g = gap[idx]
    has_prefix = np.isfinite(g)
    # Lost to expiry: the TTL took at least half of what an unbounded cache would have served
    # (a one-block coincidence, say two uuids sharing their first hex digits, is not a loss).
    lost = achievable[idx] - within_ttl[idx]
    expired = (lost * 2 > achievable[idx]) & (lost >= 2 * B)
    lost_tokens = int(lost[expired].sum())
    # Keep-warm: one refresh per TTL of idle time between requests, against the misses it saves.
    ts = trace.ts[idx]
    idle = np.diff(ts) if len(ts) > 1 else np.zeros(0)
    refreshes = int(np.floor(idle / ttl).sum())
    refresh_cost = refreshes * prefix_tokens * pricing.read_mult
    saved = lost_tokens * (pricing.write_mult - pricing.read_mult) if pricing.name != "self-hosted" else lost_tokens
    keep_warm = bool(prefix_tokens > 0 and saved > refresh_cost and lost_tokens > 0)
    dv = diverge[idx]
    dv = dv[dv >= 0]
    hist_edges = np.unique(np.linspace(0, max(int(dv.max()) if len(dv) else 1, 1), 31).astype(int))
    counts, _ = np.histogram(dv, bins=hist_edges) if len(dv) else (np.zeros(len(hist_edges) - 1), None)
    return {
        "endpoint": name,
        "tenants": sorted({trace.tenants[int(t)] for t in np.unique(trace.tenant[idx])}),
        "requests": len(idx),
        "prompt_tokens": q,
        "hit_rate": float(achieved[idx].sum() / q) if q else 0.0,
        "achievable_hit_rate": float(achievable[idx].sum() / q) if q else 0.0,
        "divergence": {
            "p10": float(np.percentile(dv, 10)) if len(dv) else None,
            "p50": float(np.percentile(dv, 50)) if len(dv) else None,
            "p90": float(np.percentile(dv, 90)) if len(dv) else None,
            "histogram": {"edges": hist_edges.tolist(), "counts": [int(c) for c in counts]},
        },
        "busting": busting,
        "stable_prefix_tokens": prefix_tokens,
        "prefix_versions": len(vs),
        "dominant_prefix_share": on_dominant / len(idx) if len(idx) else 0.0,
        "versions": [{k: v[k] for k in ("first_ts", "last_ts", "requests", "share", "change_cost_tokens", "change_cost_usd")} for v in vs],
        "ttl_s": ttl,
        "reuse_gap_s": {
            "p50": float(np.percentile(g[has_prefix], 50)) if has_prefix.any() else None,
            "p90": float(np.percentile(g[has_prefix], 90)) if has_prefix.any() else None,
            "over_ttl_share": float((g[has_prefix] >= ttl).sum() / has_prefix.sum()) if has_prefix.any() else 0.0,
            "histogram": _gap_histogram(g[has_prefix], ttl),
        },
        "ttl_expired_requests": int(expired.sum()),
        "ttl_lost_tokens": lost_tokens,
        "keep_warm": keep_warm,
        "keep_warm_prefix_tokens": prefix_tokens,
        "keep_warm_refreshes": refreshes,
        "keep_warm_cost_tokens": refresh_cost,
        "keep_warm_saved_tokens": saved,
    }


def _gap_histogram(g: np.ndarray, ttl: float) -> dict[str, list[float]]:
    """Reuse gaps on fixed edges around the TTL (seconds); the last bin is open."""
    edges = sorted({0.0, 1.0, 10.0, 60.0, ttl / 2, ttl, 2 * ttl, 3600.0, 86400.0})
    counts, _ = np.histogram(g, bins=[*edges, np.inf])
    return {"edges_s": edges, "counts": [int(c) for c in counts]}
