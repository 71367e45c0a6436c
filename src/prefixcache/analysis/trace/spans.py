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
over a sliding window (:mod:`prefixcache.server.ops.busting`).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixcache.analysis.trace.tokenize import Tokenizer

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
    # Per pair showing it: the shared tokens that all the pair's variable spans together keep out
    # of the cache (what moving every one of them below the shared content gains) ...
    shared_after: list[int] = field(default_factory=list)
    # ... and what moving this span alone gains (nothing while another span sits above it).
    alone_after: list[int] = field(default_factory=list)
    examples: list[tuple[float, str]] = field(default_factory=list)  # (ts, value)
    stacked_with: list[tuple[str, int]] = field(default_factory=list)  # other spans of its pairs

    def as_dict(self, requests: int, sampled: int) -> dict[str, Any]:
        lost = float(np.mean(self.shared_after)) if self.shared_after else 0.0
        alone = float(np.mean(self.alone_after)) if self.alone_after else lost
        share = len(self.shared_after) / sampled if sampled else 0.0
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
            "share_of_requests": share,
            "saving_tokens_if_moved_below": alone * requests * share,
            "saving_tokens_if_all_moved_below": lost * requests * share,
            "stacked_with": [{"kind": k, "start_token": t} for k, t in self.stacked_with],
        }


#: Variable spans looked for in one pair, top to bottom.
MAX_STACK = 8


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
    """Kind, value text, value start token and value end token of the span ``[start, end)``: the
    first of :func:`classify_all`."""
    return classify_all(tok, tokens, start, end)[0]


def classify_all(tok: Tokenizer, tokens: np.ndarray, start: int, end: int) -> list[tuple[str, str, int, int]]:
    """Every value in the span ``[start, end)``, top first: (kind, text, start token, end token).

    Decodes ``CONTEXT`` tokens on each side and takes, kind by kind in priority order, the regex
    matches that overlap the span's characters and no value taken before (two values a few
    tokens apart, ``Current time: ...`` then ``Request id: 7``, are two values); ``other`` (the
    span's own text) when none does.
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
    taken: list[tuple[int, int]] = []  # character ranges of the values found
    out: list[tuple[str, str, int, int]] = []
    for kind, rx in _KINDS:
        for mt in rx.finditer(text):
            if not (mt.start() < max(ce, cs + 1) and mt.end() > cs):
                continue
            if any(mt.start() < b and mt.end() > a for a, b in taken):
                continue
            taken.append((mt.start(), mt.end()))
            t0 = w0 + _token_at(offs, mt.start())
            t1 = w0 + _token_at(offs, max(mt.end() - 1, mt.start())) + 1
            out.append((kind, mt.group(0), t0, t1))
    if not out:
        return [("other", text[cs:ce].strip() or text[cs:ce], start, end)]
    return sorted(out, key=lambda v: v[2])


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
    of the request; ``shared``: the tokens it has in common with its reference again below all
    the pair's spans together (what moving every one of them gains), ``alone``: what moving this
    one alone gains (0 when another span sits above it)."""

    kind: str
    start: int
    length: int
    shared: int
    ts: float
    value: str
    alone: int = -1  # -1: as ``shared`` (a span on its own)

    def __post_init__(self) -> None:
        if self.alone < 0:
            self.alone = self.shared


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
        self.pairs: deque[list[Observation] | None] = deque(maxlen=window)
        self._tok: Tokenizer | None = None

    def __len__(self) -> int:
        """Pairs in the window (those that showed nothing included)."""
        return len(self.pairs)

    def add(self, p: Pair) -> list[Observation]:
        """Examine one pair and slide the window over it; returns what it showed (empty: no span)."""
        observations = self._observe(p)
        self.pairs.append(observations or None)
        return observations

    def _observe(self, p: Pair) -> list[Observation]:
        """Every variable span of the pair above shared content, top first: after each span the
        two prompts agree again for a run; a short run means another span follows (stacked
        values), and the scan goes on until the prompts no longer agree again. The spans down to
        the last one with at least ``min_shared`` tokens below it are the pair's stack."""
        a, b = p.ref, p.tokens
        da = db = p.diverge
        spans: list[tuple[int, int, int]] = []  # (start, end) in the request, shared run after
        for _ in range(MAX_STACK):
            if da >= len(a) or db >= len(b):
                break
            rs = resync(a[da:], b[db:], 0, probe=self.probe)
            if rs is None:
                break
            sa, sb, run = rs
            spans.append((db, db + max(sb, 1), run))
            da, db = da + sa + run, db + sb + run
        long_runs = [i for i, (_, _, run) in enumerate(spans) if run >= self.min_shared]
        if not long_runs:
            return []
        spans = spans[: long_runs[-1] + 1]
        together = sum(run for _, _, run in spans)
        if self._tok is None:
            self._tok = self.tok_loader()
        # The values in the spans, each once (a value the prompts happen to agree inside, a uuid's
        # constant middle, spans two spans), with the spans it covers.
        values: dict[tuple[int, int], tuple[str, str, int, int]] = {}
        for i, (start, end, _) in enumerate(spans):
            for kind, value, t0, t1 in classify_all(self._tok, p.tokens, start, end):
                covered = [k for k, (s0, s1, _) in enumerate(spans) if t0 < s1 and t1 > s0] or [i]
                if (t0, t1) not in values:
                    values[(t0, t1)] = (kind, value, covered[0], covered[-1])
        ordered = sorted(values.items())
        out: list[Observation] = []
        for n, ((t0, t1), (kind, value, _, last)) in enumerate(ordered):
            # Moving this one alone gains the runs down to the next value, and only if it is the
            # top one (every other value still varies above the shared content).
            if n > 0:
                alone = 0
            elif n + 1 == len(ordered):
                alone = together
            else:
                alone = sum(run for _, _, run in spans[last : ordered[1][1][2]])
            out.append(Observation(kind, t0, t1 - t0, together, p.ts, value, alone))
        return out

    def findings(self) -> list[Finding]:
        """The spans seen often enough in the window, by start token (ties: first seen first). One
        value is one finding even where its first token moves by one from prompt to prompt (a
        tokenizer merging the value's first characters with the text before them)."""
        groups: dict[tuple[str, int], Finding] = {}
        members: list[list[tuple[str, int]]] = []  # per pair: the groups its spans fell in
        for obs in self.pairs:
            if not obs:
                continue
            keys = []
            for o in obs:
                f = groups.get((o.kind, o.start))
                if f is None:
                    f = groups[(o.kind, o.start)] = Finding(o.kind, o.start, max(o.length, 1))
                f.length_tokens = max(f.length_tokens, o.length)
                f.shared_after.append(o.shared)
                f.alone_after.append(o.alone)
                f.examples.append((o.ts, o.value))
                keys.append((o.kind, o.start))
            members.append(keys)
        merged = _merge_overlapping(groups)
        need = max(2, int(self.min_share * len(self.pairs)))
        out = {k: f for k, f in merged.items() if len(f.shared_after) >= need}
        for f in out.values():
            if f.kind == "counter" and not _increasing(f.examples):
                f.kind = "other"
        alias = {k: _root(k, merged, groups) for k in groups}
        for key, f in out.items():
            seen_with: dict[tuple[str, int], int] = {}
            for keys in members:
                roots = {alias[k] for k in keys}
                if key in roots:
                    for r in roots - {key}:
                        seen_with[r] = seen_with.get(r, 0) + 1
            f.stacked_with = sorted(
                (
                    (out[r].kind, out[r].start_token)
                    for r, n in seen_with.items()
                    if r in out and 2 * n >= len(f.shared_after)
                ),
                key=lambda kt: kt[1],
            )
        return sorted(out.values(), key=lambda f: f.start_token)


def _merge_overlapping(groups: dict[tuple[str, int], Finding]) -> dict[tuple[str, int], Finding]:
    """Groups of one kind whose token ranges overlap, merged into the one seen most often (its
    start and key kept); the others are emptied and dropped."""
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1].shared_after))
    kept: dict[tuple[str, int], Finding] = {}
    for key, f in ordered:
        host = next(
            (
                h
                for h in kept.values()
                if h.kind == f.kind
                and f.start_token < h.start_token + h.length_tokens
                and h.start_token < f.start_token + f.length_tokens
            ),
            None,
        )
        if host is None:
            kept[key] = f
            continue
        host.length_tokens = max(host.length_tokens, f.length_tokens)
        host.shared_after += f.shared_after
        host.alone_after += f.alone_after
        host.examples += f.examples
        f.start_token = -1 - host.start_token  # marks the merged group: see _root
    return kept


def _root(
    key: tuple[str, int], merged: dict[tuple[str, int], Finding], groups: dict[tuple[str, int], Finding]
) -> tuple[str, int]:
    """The key of the merged group that ``key``'s observations ended in."""
    if key in merged:
        return key
    f = groups[key]
    return (f.kind, -1 - f.start_token)


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
