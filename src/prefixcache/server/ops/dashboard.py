"""The live dashboard's data (``GET /v1/dashboard``; the page itself is :mod:`prefixcache.webui`).

:class:`DashboardRecorder` keeps three small, bounded things about the traffic since start:

* **totals** (requests, prompt / cached / written tokens) and the last TTFTs of each cache
  outcome, counted by :meth:`~DashboardRecorder.note` on the event loop in O(1);
* a **time series**: a ring buffer of ``points`` samples, one per ``interval_s``, each the tokens
  of that interval (prompt, cached, written, prefilled), its hit rate, the median TTFT of its hits
  and misses and the queue depth; a daemon thread samples it, so it reads nothing under the
  cache's lock and never runs on the event loop;
* the **top prefixes** of each tenant by tokens saved. A prefix is what a hit read: the chain of
  blocks ending at the last cached block, named by that block's key (the same salted key the
  cache holds; the salt itself never leaves the server). Noted requests wait in a bounded queue
  and are digested (block keys hashed, a short preview decoded) off the loop, by the sampler or
  by a read. Each tenant keeps at most ``2 * top + 1`` prefixes; past that, the ``top`` that
  saved most and the one just hit stay, so a prefix of the long tail that climbs slowly may be
  forgotten (and counted afresh when it comes back).

Everything here is server-wide except the top prefixes, which :meth:`~DashboardRecorder.view`
filters by tenant (an admin sees every tenant's). The server-wide numbers are those ``/metrics``
already publishes.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
DEFAULT_POINTS = 300  # 10 minutes at the default interval
DEFAULT_TOP = 20
PENDING_MAX = 2048  # noted hits waiting to be digested; beyond, the oldest are dropped (counted)
TTFT_KEPT = 256  # last TTFTs kept per outcome for the percentiles
PREVIEW_HEAD_TOKENS = 24
PREVIEW_TAIL_TOKENS = 12
PREVIEW_MAX_CHARS = 160
OUTCOMES = ("hit", "partial", "miss")
CREDENTIALS_KEPT = 64  # per top-prefix entry: beyond, a new caller's hits no longer unlock its preview
#: Prompt-length buckets (tokens, upper bound excluded) for comparing hit and miss TTFTs: a miss
#: of a short prompt is faster than a hit of a long one, which says nothing about the cache.
LENGTH_BUCKETS = ((1, 512), (512, 2048), (2048, 8192), (8192, None))


@dataclass(frozen=True, slots=True)
class DashboardSources:
    """What the recorder reads, as callables (the app wires them; tests can fake them).

    ``keys(tenant, salt, token_ids)``: the cache's block keys of those tokens in the tenant's
    namespace; ``decode(token_ids)``: their text; ``prefilled()``: the engine's computed prompt
    tokens since start; ``queue_depth()``: generation requests admitted and not finished."""

    keys: Callable[[str, bytes, list[int]], Sequence[bytes]]
    decode: Callable[[list[int]], str]
    prefilled: Callable[[], int]
    queue_depth: Callable[[], int]


@dataclass(slots=True)
class PrefixEntry:
    """One prefix of the top list: tokens saved by every hit that read exactly this prefix."""

    key: str  # hex of the prefix's last block key
    tenant: str
    prefix_tokens: int
    preview: str
    tokens_saved: int = 0
    hits: int = 0
    last_hit: float = 0.0  # unix time
    #: the API keys (credential digests) whose requests hit this prefix (at most CREDENTIALS_KEPT)
    credentials: set[str] = field(default_factory=set)

    def as_dict(self, viewer: str | None = None) -> dict[str, Any]:
        """The entry as JSON; ``viewer``: the credential asking (None: one who sees every preview),
        shown the preview only when its own requests hit this prefix."""
        shown = viewer is None or viewer in self.credentials
        return {
            "key": self.key,
            "tenant": self.tenant,
            "prefix_tokens": self.prefix_tokens,
            "tokens_saved": self.tokens_saved,
            "hits": self.hits,
            "last_hit": round(self.last_hit, 3),
            "preview": self.preview if shown else None,
            **({} if shown else {"preview_hidden": True}),
        }


@dataclass(slots=True)
class _Pending:
    credential: str
    tenant: str
    salt: bytes
    prefix: list[int]  # the cached tokens (the prompt's first ``cached_tokens``)
    at: float


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    written_tokens: int = 0
    ttft: dict[str, list[float]] = field(default_factory=lambda: {o: [] for o in OUTCOMES})
    # TTFT per 1,000 prompt tokens: comparable across prompt lengths
    ttft_k: dict[str, list[float]] = field(default_factory=lambda: {o: [] for o in OUTCOMES})


def _bucket(prompt_tokens: int) -> int:
    """The index of the :data:`LENGTH_BUCKETS` entry holding ``prompt_tokens``."""
    for i, (_, hi) in enumerate(LENGTH_BUCKETS):
        if hi is None or prompt_tokens < hi:
            return i
    return len(LENGTH_BUCKETS) - 1


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6)


def preview(decode: Callable[[list[int]], str], tokens: list[int]) -> str:
    """A short, one-line text of a prefix: its first tokens, and its last ones if it is longer."""
    if len(tokens) <= PREVIEW_HEAD_TOKENS + PREVIEW_TAIL_TOKENS:
        text = decode(tokens)
    else:
        head = decode(tokens[:PREVIEW_HEAD_TOKENS])
        tail = decode(tokens[-PREVIEW_TAIL_TOKENS:])
        text = f"{head} … {tail}"
    text = " ".join(text.split())  # newlines and runs of spaces: one space
    return text if len(text) <= PREVIEW_MAX_CHARS else text[: PREVIEW_MAX_CHARS - 1] + "…"


class DashboardRecorder:
    """The dashboard's counters, series and top prefixes (see the module docstring). Thread-safe:
    :meth:`note` runs on the event loop, :meth:`sample` in the sampler thread, :meth:`view` in a
    snapshot thread; one lock guards the state, and hashing and decoding run outside it."""

    def __init__(
        self,
        sources: DashboardSources,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        points: int = DEFAULT_POINTS,
        top: int = DEFAULT_TOP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or points < 2 or top < 1:
            raise ValueError("the dashboard needs interval_s > 0, points >= 2 and top >= 1")
        self.sources = sources
        self.interval_s = interval_s
        self.top = top
        self.clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self._digest_lock = threading.Lock()  # one digester at a time: entries see hits in order
        self._totals = _Counts()
        self._interval = _Counts()  # since the last sample
        self._ttft: dict[str, deque[float]] = {o: deque(maxlen=TTFT_KEPT) for o in OUTCOMES}
        self._by_length: list[dict[str, deque[float]]] = [
            {o: deque(maxlen=TTFT_KEPT) for o in OUTCOMES} for _ in LENGTH_BUCKETS
        ]
        self._series: deque[dict[str, Any]] = deque(maxlen=points)
        self._last_prefilled = 0
        self._pending: deque[_Pending] = deque()
        self.dropped = 0  # noted hits dropped from a full queue before they were digested
        self._prefixes: dict[str, dict[str, PrefixEntry]] = {}  # tenant -> key -> entry
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ writers
    def note(
        self,
        tenant: str,
        salt: bytes,
        prompt_token_ids: list[int],
        prompt_tokens: int,
        cached_tokens: int,
        written_tokens: int,
        ttft_s: float | None,
        outcome: str,
        *,
        credential: str = "",
    ) -> None:
        """Count one finished generation (``credential``: which API key sent it). O(1) apart from
        copying the cached token ids."""
        with self._lock:
            for counts in (self._totals, self._interval):
                counts.requests += 1
                counts.prompt_tokens += prompt_tokens
                counts.cached_tokens += cached_tokens
                counts.written_tokens += written_tokens
            if ttft_s is not None and outcome in self._ttft:
                self._ttft[outcome].append(ttft_s)
                self._interval.ttft[outcome].append(ttft_s)
                if prompt_tokens > 0:
                    self._interval.ttft_k[outcome].append(ttft_s * 1000 / prompt_tokens)
                    self._by_length[_bucket(prompt_tokens)][outcome].append(ttft_s)
            if cached_tokens > 0 and len(prompt_token_ids) >= cached_tokens:
                if len(self._pending) >= PENDING_MAX:
                    self._pending.popleft()
                    self.dropped += 1
                self._pending.append(
                    _Pending(credential, tenant, salt, list(prompt_token_ids[:cached_tokens]), self.clock())
                )

    def sample(self) -> dict[str, Any]:
        """Close the current interval: append its point to the series (and digest noted hits)."""
        self.digest()
        prefilled = int(self.sources.prefilled())
        depth = int(self.sources.queue_depth())
        with self._lock:
            c, self._interval = self._interval, _Counts()
            point = {
                "t": round(self.clock(), 3),
                "requests": c.requests,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "written_tokens": c.written_tokens,
                "prefilled_tokens": max(0, prefilled - self._last_prefilled),
                "hit_rate": round(c.cached_tokens / c.prompt_tokens, 4) if c.prompt_tokens else None,
                "ttft_hit_s": _median(c.ttft["hit"]),
                "ttft_partial_s": _median(c.ttft["partial"]),
                "ttft_miss_s": _median(c.ttft["miss"]),
                "ttft_hit_per_1k_s": _median(c.ttft_k["hit"]),
                "ttft_partial_per_1k_s": _median(c.ttft_k["partial"]),
                "ttft_miss_per_1k_s": _median(c.ttft_k["miss"]),
                "queue_depth": depth,
            }
            self._last_prefilled = prefilled
            self._series.append(point)
        return point

    def digest(self) -> int:
        """Turn the noted hits into top-prefix entries (hashing and decoding outside the state
        lock). Returns how many were digested."""
        with self._digest_lock:
            with self._lock:
                batch = list(self._pending)
                self._pending.clear()
            done: list[tuple[_Pending, str, str | None]] = []
            for p in batch:
                try:
                    keys = self.sources.keys(p.tenant, p.salt, p.prefix)
                except Exception:  # the cache was switched off under us: nothing to name
                    log.exception("dashboard: block keys of a hit failed")
                    continue
                if not keys:
                    continue
                key = keys[-1].hex()
                with self._lock:
                    known = key in self._prefixes.get(p.tenant, {})
                done.append((p, key, None if known else preview(self.sources.decode, p.prefix)))
            with self._lock:
                for p, key, text in done:
                    entries = self._prefixes.setdefault(p.tenant, {})
                    entry = entries.get(key)
                    if entry is None:  # (trimmed earlier in this batch when ``text`` is None)
                        text = text if text is not None else preview(self.sources.decode, p.prefix)
                        entry = PrefixEntry(key, p.tenant, len(p.prefix), text)
                        entries[key] = entry
                    if len(entry.credentials) < CREDENTIALS_KEPT:
                        entry.credentials.add(p.credential)
                    entry.tokens_saved += len(p.prefix)
                    entry.hits += 1
                    entry.last_hit = max(entry.last_hit, p.at)
                    if len(entries) > 2 * self.top:  # keep the best, and the one just hit
                        ranked = sorted(entries.values(), key=lambda e: e.tokens_saved, reverse=True)
                        self._prefixes[p.tenant] = {e.key: e for e in (*ranked[: self.top], entry)}
            return len(done)

    # ------------------------------------------------------------------ readers
    def top_prefixes(self, tenant: str | None, viewer: str | None = None) -> list[dict[str, Any]]:
        """The prefixes that saved most, of ``tenant`` (None: of every tenant), best first;
        ``viewer``: see :meth:`PrefixEntry.as_dict`."""
        self.digest()
        with self._lock:
            if tenant is None:
                pool = [e for entries in self._prefixes.values() for e in entries.values()]
            else:
                pool = list(self._prefixes.get(tenant, {}).values())
            pool.sort(key=lambda e: (-e.tokens_saved, e.key))
            return [e.as_dict(viewer) for e in pool[: self.top]]

    def view(self, tenant: str | None, viewer: str | None = None) -> dict[str, Any]:
        """The recorder's part of ``GET /v1/dashboard``: totals, TTFT by outcome, the series and
        the top prefixes of ``tenant`` (None: every tenant's; ``viewer``: whose previews show)."""
        top = self.top_prefixes(tenant, viewer)
        prefilled = int(self.sources.prefilled())
        depth = int(self.sources.queue_depth())
        with self._lock:
            t = self._totals
            ttft = {
                o: {
                    "count": len(self._ttft[o]),
                    "p50_s": _percentile(self._ttft[o], 0.5),
                    "p90_s": _percentile(self._ttft[o], 0.9),
                }
                for o in OUTCOMES
            }
            return {
                "now": round(self.clock(), 3),
                "uptime_s": round(self.clock() - self.started, 3),
                "interval_s": self.interval_s,
                "totals": {
                    "requests": t.requests,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                    "written_tokens": t.written_tokens,
                    "prefilled_tokens": prefilled,
                    "hit_rate": round(t.cached_tokens / t.prompt_tokens, 4) if t.prompt_tokens else 0.0,
                    "queue_depth": depth,
                },
                "ttft": ttft,
                "ttft_by_length": [
                    {
                        "min_tokens": lo,
                        "max_tokens": hi,
                        **{
                            o: {
                                "count": len(q[o]),
                                "p50_s": _percentile(q[o], 0.5),
                                "p90_s": _percentile(q[o], 0.9),
                            }
                            for o in OUTCOMES
                        },
                    }
                    for (lo, hi), q in zip(LENGTH_BUCKETS, self._by_length, strict=True)
                    if any(q[o] for o in OUTCOMES)
                ],
                "series": list(self._series),
                "top_prefixes": top,
                "dropped_hits": self.dropped,
            }

    # ------------------------------------------------------------------ the sampler thread
    def start(self) -> None:
        """Sample every ``interval_s`` in a daemon thread until :meth:`close`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="prefixcache-dashboard", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # the sampler must outlive one bad read
                log.exception("dashboard: sampling failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
