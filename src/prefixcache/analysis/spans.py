"""Cache-busting spans: variable content that sits above a long shared region.

Given pairs (request, the most similar earlier request of its endpoint) and the token where they
first differ, :func:`find_busting` looks for the point where the two resynchronise (a run of
``probe`` equal tokens), measures the shared region after it, and, when that region is long,
classifies the variable span by regexes over its decoded text (with a little context, since the
first differing token is often inside a value: ``...T22:07:28`` vs ``...T22:07:31``):

``uuid`` > ``timestamp`` (ISO 8601 date-time, or epoch seconds/milliseconds) > ``hex_id`` >
``counter`` (integers that increase with time across the examples) > ``other``.

Findings are grouped by (kind, token position of the value's start). One implementation serves
both detectors: :class:`BustingDetector` takes pairs one at a time; the audit feeds it an
endpoint's sampled pairs (:func:`find_busting`), the server each finished request of an endpoint
over a sliding window (:mod:`prefixcache.server.busting`).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixcache.analysis.trace import Tokenizer

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?")
_EPOCH = re.compile(r"(?<!\d)1[4-9]\d{8}(?:\d{3})?(?:\.\d+)?(?!\d)")
_HEX = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}(?![0-9A-Za-z])")
_INT = re.compile(r"(?<!\d)\d+(?!\d)")
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("uuid", _UUID),
    ("timestamp", _ISO),
    ("timestamp", _EPOCH),
    ("hex_id", _HEX),
    ("counter", _INT),
)
CONTEXT = 48  # tokens of context decoded on each side of a span


@dataclass(slots=True)
class Pair:
    request: int  # index in the trace
    ts: float
    tokens: np.ndarray  # the request's prompt
    ref: np.ndarray  # the most similar earlier request's prompt
    diverge: int  # first token where they differ


@dataclass(slots=True)
class Finding:
    kind: str
    start_token: int
    length_tokens: int
    shared_after: list[int] = field(default_factory=list)  # shared tokens below, per pair
    examples: list[tuple[float, str]] = field(default_factory=list)  # (ts, value)

    def as_dict(self, requests: int, sampled: int) -> dict[str, Any]:
        lost = float(np.mean(self.shared_after)) if self.shared_after else 0.0
        seen: list[str] = []
        for _, v in sorted(self.examples):
            if v not in seen:
                seen.append(v)
        return {
            "start_token": self.start_token,
            "length_tokens": self.length_tokens,
            "kind": self.kind,
            "examples": seen[:3],
            "tokens_lost_per_request": lost,
            "share_of_requests": len(self.shared_after) / sampled if sampled else 0.0,
            "saving_tokens_if_moved_below": (
                lost * requests * (len(self.shared_after) / sampled if sampled else 0.0)
            ),
        }


def resync(
    a: np.ndarray, b: np.ndarray, d: int, *, probe: int = 16, max_span: int = 256
) -> tuple[int, int, int] | None:
    """Where ``a`` and ``b`` (equal before ``d``) agree again: ``(span_a, span_b, shared)``.

    Returns the smallest ``span_b`` (then the nearest ``span_a``) such that
    ``b[d+span_b : d+span_b+probe]`` occurs in ``a`` at ``d+span_a`` (``span_a <= max_span``),
    with the length of the equal run from there; None if they never do within ``max_span``.
    """
    ab = a.astype("<u4", copy=False).tobytes()
    lim = min(len(a), d + max_span + probe)
    for sb in range(0, min(max_span, len(b) - d - probe) + 1):
        needle = b[d + sb : d + sb + probe].astype("<u4", copy=False).tobytes()
        pos = ab.find(needle, 4 * d, 4 * lim)
        while pos >= 0 and pos % 4:
            pos = ab.find(needle, pos + 1, 4 * lim)
        if pos < 0:
            continue
        sa = pos // 4 - d
        if sa == 0 and sb == 0:
            continue  # not a divergence at all (cannot happen for a true first difference)
        x, y = a[d + sa :], b[d + sb :]
        n = min(len(x), len(y))
        neq = np.flatnonzero(x[:n] != y[:n])
        return sa, sb, int(neq[0]) if len(neq) else n
    return None


def classify(tok: Tokenizer, tokens: np.ndarray, start: int, end: int) -> tuple[str, str, int, int]:
    """Kind, value text, value start token and value end token of the span ``[start, end)``.

    Decodes ``CONTEXT`` tokens on each side and picks the highest-priority regex match that
    overlaps the span's characters; ``other`` (the span's own text) when none does.
    """
    w0 = max(0, start - CONTEXT)
    w1 = min(len(tokens), end + CONTEXT)
    ids = tokens[w0:w1].tolist()
    # Character offset of each token boundary (decode of growing prefixes: exact for any tokenizer).
    offs = [0]
    text = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        offs.append(len(text))
    cs, ce = offs[start - w0], offs[end - w0]
    for kind, rx in _KINDS:
        for mt in rx.finditer(text):
            if mt.start() < max(ce, cs + 1) and mt.end() > cs:
                t0 = w0 + _token_at(offs, mt.start())
                t1 = w0 + _token_at(offs, max(mt.end() - 1, mt.start())) + 1
                return kind, mt.group(0), t0, t1
    return "other", text[cs:ce].strip() or text[cs:ce], start, end


def _token_at(offs: list[int], ch: int) -> int:
    """Index of the token whose characters contain offset ``ch``."""
    lo, hi = 0, len(offs) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offs[mid] <= ch:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class Observation:
    """What one pair showed: a variable span of ``kind`` over tokens ``[start, start + length)``
    of the request, above ``shared`` tokens it has in common with its reference again."""

    kind: str
    start: int
    length: int
    shared: int
    ts: float
    value: str


class BustingDetector:
    """The busting signature over pairs (request, its most similar earlier request): one
    implementation, fed a pair at a time. The audit adds an endpoint's sampled pairs and reads
    :meth:`findings` once (:func:`find_busting`); the server adds each request of an endpoint as
    it finishes and reads the findings over a sliding ``window`` of the last pairs.

    A pair counts when its request and reference resynchronise after the first difference (a run
    of ``probe`` equal tokens) and share at least ``min_shared`` tokens from there; its span is
    classified (:func:`classify`) by decoding a little context with ``tok_loader()``'s tokenizer,
    loaded on the first pair that needs it. A finding is a (kind, value start) seen in at least
    ``min_share`` of the pairs in the window (and 2). Memory: ``window`` observations (None:
    every pair added, the audit's case)."""

    def __init__(
        self,
        tok_loader: Any,
        *,
        min_shared: int = 64,
        probe: int = 16,
        min_share: float = 0.1,
        window: int | None = None,
    ) -> None:
        self.tok_loader = tok_loader
        self.min_shared = min_shared
        self.probe = probe
        self.min_share = min_share
        self.pairs: deque[Observation | None] = deque(maxlen=window)
        self._tok: Tokenizer | None = None

    def __len__(self) -> int:
        """Pairs in the window (those that showed nothing included)."""
        return len(self.pairs)

    def add(self, p: Pair) -> Observation | None:
        """Examine one pair and slide the window over it; returns what it showed (None: no span)."""
        observation = self._observe(p)
        self.pairs.append(observation)
        return observation

    def _observe(self, p: Pair) -> Observation | None:
        rs = resync(p.ref, p.tokens, p.diverge, probe=self.probe)
        if rs is None:
            return None
        _, sb, shared = rs
        if shared < self.min_shared:
            return None
        if self._tok is None:
            self._tok = self.tok_loader()
        kind, value, t0, t1 = classify(self._tok, p.tokens, p.diverge, p.diverge + max(sb, 1))
        return Observation(kind, t0, t1 - t0, shared, p.ts, value)

    def findings(self) -> list[Finding]:
        """The spans seen often enough in the window, by start token (ties: first seen first)."""
        groups: dict[tuple[str, int], Finding] = {}
        for o in self.pairs:
            if o is None:
                continue
            f = groups.get((o.kind, o.start))
            if f is None:
                f = groups[(o.kind, o.start)] = Finding(o.kind, o.start, max(o.length, 1))
            f.length_tokens = max(f.length_tokens, o.length)
            # The shared run below the span is what the span keeps out of the cache.
            f.shared_after.append(o.shared)
            f.examples.append((o.ts, o.value))
        need = max(2, int(self.min_share * len(self.pairs)))
        out = [f for f in groups.values() if len(f.shared_after) >= need]
        for f in out:
            if f.kind == "counter" and not _increasing(f.examples):
                f.kind = "other"
        return sorted(out, key=lambda f: f.start_token)


def find_busting(
    pairs: Sequence[Pair], tok_loader: Any, *, min_shared: int = 64, probe: int = 16, min_share: float = 0.1
) -> list[Finding]:
    """Busting spans among ``pairs`` (one endpoint's sample): a :class:`BustingDetector` fed
    every pair. ``tok_loader()`` gives the tokenizer; it is called only when a candidate needs
    decoding. A finding must sit above at least ``min_shared`` shared tokens and appear in at
    least ``min_share`` of the pairs (and 2)."""
    detector = BustingDetector(tok_loader, min_shared=min_shared, probe=probe, min_share=min_share)
    for p in pairs:
        detector.add(p)
    return detector.findings()


def _increasing(examples: list[tuple[float, str]]) -> bool:
    vals = [int(v) for _, v in sorted(examples) if v.isdigit()]
    return len(vals) >= 2 and all(b > a for a, b in zip(vals, vals[1:], strict=False))
