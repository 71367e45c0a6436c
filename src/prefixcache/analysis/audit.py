"""Why a trace's hit rate is what it is: busting spans, prefix stability, TTL versus traffic.

The audit is three steps, each its own module:

1. the scan (:mod:`~prefixcache.analysis.audit_scan`): one pass over the trace (a
   :class:`~prefixcache.analysis.feed.TraceFeed`: the requests in time order with their chained
   block keys) computing per request the achievable and within-TTL prefix depths, the reuse gap,
   and the first token that differs from the most similar earlier request of its endpoint;
2. the achieved hits (this module): from the trace's ``cached_tokens`` when every line has it,
   else what the real PrefixCache serves with unbounded capacity and the given TTL;
3. the findings (:mod:`~prefixcache.analysis.audit_findings`): per endpoint, busting spans,
   prefix versions, reuse gaps against the TTL and keep-warm, priced.

Achieved hits without a replay: the scan already has them. The within-TTL depth is, request for
request, the hit an unbounded PrefixCache with that TTL gives (a block lives while something in
its subtree was used within the TTL, and a hit is capped and aligned the same way).
``tests/analysis/test_audit.py`` holds the two equal against a replay through the real
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.audit_findings import NO_TEXT_FINDINGS, endpoint_rows, has_token_text
from prefixcache.analysis.audit_scan import scan
from prefixcache.analysis.config import AuditConfig, SimConfig
from prefixcache.analysis.feed import TraceFeed, TraceUnsorted, can_stream, stream
from prefixcache.analysis.simulate import simulate
from prefixcache.analysis.trace import Trace, TraceFormatError, iter_lines, load_trace
from prefixcache.analysis.trace.keychains import paused_gc

log = logging.getLogger(__name__)

__all__ = ["AuditConfig", "AuditResult", "audit", "audit_file"]


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
    unavailable: list[str] = field(default_factory=list)  # findings this trace cannot give, and why

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
            **({"unavailable_findings": self.unavailable} if self.unavailable else {}),
        }


def audit(
    trace: Trace, cfg: AuditConfig, *, progress: Callable[[str, int], None] | None = None
) -> AuditResult:
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
    path: str | Path,
    cfg: AuditConfig,
    *,
    tokenizer: str | None = None,
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
            feeds = stream(
                path,
                fingerprint=cfg.fingerprint,
                block_size=cfg.block_size,
                tokenizer=tokenizer,
                consumers=2 if replay else 1,
            )
            if replay:
                child = _ReplayChild.start(feeds[1], cfg, close=feeds[0])
                feeds[1].detach()
        except OSError as exc:  # pragma: no cover - out of processes
            log.warning("audit: cannot start a reader process (%s); loading the trace first", exc)
        else:
            feed = feeds[0]
            report = None
            if progress is not None:

                def report(stage: str, done: int) -> None:
                    if stage == "scan":
                        progress("reading and scanning", feed.position, feed.size)
                    else:
                        progress(stage, done, len(feed.endpoints) if stage == "endpoints" else len(feed.ts))

            try:
                with paused_gc():
                    return _audit(feed, cfg, report, child)
            except TraceUnsorted as exc:
                log.info("%s; loading and sorting the whole trace instead", exc)
            finally:
                feed.close()
                if child is not None:
                    child.close()
    trace = load_trace(
        path,
        tokenizer=tokenizer,
        progress=(lambda k: progress("reading", k, 0)) if progress is not None else None,
    )
    n = len(trace)
    return audit(
        trace,
        cfg,
        progress=(lambda stage, k: progress(stage, k, len(trace.endpoints) if stage == "endpoints" else n))
        if progress is not None
        else None,
    )


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
    """Scan ``feed``, settle the achieved hits (the trace's, the scan's, or a replay's: see the
    module docstring; ``child`` is a replay already running beside the scan), then the findings."""
    found = scan(
        feed,
        block_size=cfg.block_size,
        align_tokens=cfg.align_tokens,
        ttl_s=cfg.ttl_s,
        stable_quantile=cfg.stable_quantile,
        progress=progress,
    )
    trace = feed.trace()
    ttl = cfg.ttl_s
    if not cfg.replay or bool(trace.has_cached.all()):
        achieved, source = trace.cached_tokens.astype(np.int64), "trace cached_tokens"
    elif not _needs_replay(cfg, False, bool(np.isfinite(trace.ttl_s).any())):
        achieved = found.within_ttl
        source = f"PrefixCache, TTL {ttl:g} s, unbounded capacity: the scan's within-TTL hits"
    else:
        achieved = child.result() if child is not None else None
        if achieved is None:
            achieved = _replay(trace, cfg, progress)
        elif progress is not None:
            progress("replay", len(trace))
        source = f"replay through PrefixCache (TTL {ttl:g} s, unbounded capacity)"
    rows = endpoint_rows(trace, cfg, achieved, found, progress)
    prompt_tokens = int(trace.prompt_tokens.sum())
    return AuditResult(
        config=cfg,
        ts=trace.ts,
        endpoint=trace.endpoint,
        prompt_tokens=trace.prompt_tokens,
        achieved=achieved,
        achievable=found.achievable,
        diverge=found.diverge,
        gap_s=found.gap_s,
        endpoints=rows,
        endpoint_names=list(trace.endpoints),
        achieved_source=source,
        hit_rate=float(achieved.sum() / prompt_tokens) if prompt_tokens else 0.0,
        achievable_hit_rate=float(found.achievable.sum() / prompt_tokens) if prompt_tokens else 0.0,
        unavailable=[] if has_token_text(trace) else list(NO_TEXT_FINDINGS),
    )


def _replay_config(cfg: AuditConfig) -> SimConfig:
    return SimConfig(
        ttl_s=cfg.ttl_s,
        capacity_bytes=1 << 62,
        block_size=cfg.block_size,
        align_tokens=cfg.align_tokens,
        replicas=1,
        pricing=(),
        fingerprint=cfg.fingerprint,
    )


def _replay(
    trace: Trace | TraceFeed, cfg: AuditConfig, progress: Callable[[str, int], None] | None
) -> np.ndarray:
    """Cached tokens per request from replaying ``trace`` through the real PrefixCache."""
    report = (lambda done: progress("replay", done)) if progress is not None else None
    return simulate(trace, _replay_config(cfg), progress=report).cached.astype(np.int64, copy=False)


_FORK_MIN_REQUESTS = 20_000  # below this a fork costs more than running the replay after the scan


class _ReplayChild:
    """The replay in a forked child process; it sends back only the ``cached`` int64 array."""

    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc, self.conn = proc, conn

    @classmethod
    def start(
        cls, source: Trace | TraceFeed, cfg: AuditConfig, close: TraceFeed | None = None
    ) -> _ReplayChild | None:
        """None where fork is unavailable (or fails): the caller replays in-process. ``close``:
        a feed of this process's that the child must not hold open."""
        if "fork" not in mp.get_all_start_methods():
            return None
        ctx = mp.get_context("fork")
        try:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_replay_child_main, args=(source, cfg, send, close), daemon=True)
            proc.start()
        # OSError: out of processes; AssertionError: called inside a daemon process.
        except (OSError, AssertionError) as exc:  # pragma: no cover
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


def _replay_child_main(
    source: Trace | TraceFeed, cfg: AuditConfig, conn: Any, close: TraceFeed | None
) -> None:
    """The child's body: replay, send the int64 ``cached`` array as bytes, close the pipe."""
    if close is not None:
        close.detach()
    try:
        with paused_gc():
            cached = _replay(source, cfg, None)
        conn.send_bytes(np.ascontiguousarray(cached, dtype=np.int64).tobytes())
    finally:
        conn.close()
