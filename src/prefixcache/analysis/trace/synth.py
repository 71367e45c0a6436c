"""Seeded synthetic traces of the scenarios that make or break prompt caching.

Each endpoint has a shared system prompt, an arrival process, optional prompt deploys (the
system prompt changes at given times), an optional busting bug (a timestamp, uuid, counter...
written at the top of or inside the system prompt), a tenant, and single- or multi-turn chats.
The same seed and specs always give the same file.

Tokens come from :class:`~prefixcache.analysis.trace.ByteTokenizer` by default (one token per
byte: instant, exact to decode) or from any tokenizer ``load_tokenizer`` knows. The header line
records the specs and, under ``"planted"``, where each busting value sits, so tests can check
the audit against the truth.
"""

from __future__ import annotations

import logging
import uuid as uuid_mod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.trace.keychains import paused_gc
from prefixcache.analysis.trace.tokenize import load_tokenizer
from prefixcache.analysis.trace.writer import TraceWriter

log = logging.getLogger(__name__)

BUST_KINDS = ("timestamp", "epoch", "uuid", "hex_id", "counter")
ARRIVALS = ("poisson", "bursty", "diurnal")
_PROSE = (
    "the assistant must answer politely and cite the policy section when refunds shipping orders "
    "account billing invoices are discussed never reveal internal notes always confirm the customer "
    "identity before changing any data use short paragraphs prefer bullet lists for steps escalate "
    "to a human agent when the user asks or when safety legal or medical topics arise tools search "
    "lookup_order create_ticket update_address are available return json when asked be concise"
)
_WORDS = _PROSE.split()


@dataclass(slots=True)
class EndpointSpec:
    """One endpoint's traffic. Parse from ``name:key=value,...`` with :func:`parse_endpoint`."""

    name: str
    rate: float = 1.0  # mean requests per second
    system: int = 1024  # system prompt length in tokens
    user: int = 48  # mean user message length in tokens
    output: int = 128  # mean output tokens
    bust: str | None = None  # one of BUST_KINDS, or several stacked one below the other: timestamp+counter
    bust_at: str = "top"  # "top", "middle" or "bottom" (after it: the fixed layout) of the system prompt
    deploys: tuple[float, ...] = ()  # seconds from the start when the system prompt changes
    turns: int = 1  # turns per conversation (multi-turn chats when > 1)
    tenant: str = "default"
    arrival: str = "poisson"  # one of ARRIVALS


def parse_endpoint(text: str) -> EndpointSpec:
    """``support:rate=5,system=2000,bust=timestamp,bust_at=middle,deploys=600;1200,turns=3``."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"endpoint spec {text!r} needs a name before ':'")
    spec = EndpointSpec(name=name)
    known = {f.name for f in fields(EndpointSpec)}
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        if key not in known or key == "name":
            raise ValueError(
                f"unknown endpoint setting {key!r} in {text!r}; known: {sorted(known - {'name'})}"
            )
        if key in ("rate",):
            setattr(spec, key, float(val))
        elif key in ("system", "user", "output", "turns"):
            setattr(spec, key, int(val))
        elif key == "deploys":
            spec.deploys = tuple(float(v) for v in val.split(";") if v)
        else:
            setattr(spec, key, val or None)
    if spec.bust is not None and not set(spec.bust.split("+")) <= set(BUST_KINDS):
        raise ValueError(
            f"bust={spec.bust!r}: choose one of {', '.join(BUST_KINDS)}, or stack some: timestamp+counter"
        )
    if spec.bust_at not in ("top", "middle", "bottom"):
        raise ValueError(f"bust_at={spec.bust_at!r}: choose top, middle or bottom")
    if spec.arrival not in ARRIVALS:
        raise ValueError(f"arrival={spec.arrival!r}: choose one of {', '.join(ARRIVALS)}")
    return spec


#: The default scenario: the classic prompt-caching failure modes side by side.
DEFAULT_SCENARIO = (
    "chat:rate=4,system=1200,turns=3,tenant=acme",
    "support:rate=2,system=1600,bust=timestamp,tenant=acme",
    "search:rate=1,system=800,bust=uuid,bust_at=middle,tenant=globex",
    "agent:rate=1.5,system=2000,deploys=1800;5400,tenant=globex",
    "nightly:rate=0.002,system=1400,tenant=acme",
)


@dataclass(slots=True)
class SynthResult:
    path: Path
    requests: int
    duration_s: float
    planted: list[dict[str, Any]] = field(default_factory=list)


def _arrivals(spec: EndpointSpec, duration: float, rng: np.random.Generator) -> np.ndarray:
    if spec.rate <= 0:
        return np.zeros(0)
    if spec.arrival == "poisson":
        n = rng.poisson(spec.rate * duration)
        return np.sort(rng.uniform(0, duration, n))
    if spec.arrival == "bursty":  # bursts of ~10 requests within ~5 s
        starts = np.sort(rng.uniform(0, duration, rng.poisson(spec.rate * duration / 10)))
        if not len(starts):
            return np.zeros(0)
        ts = np.concatenate([s + rng.uniform(0, 5, rng.poisson(10)) for s in starts])
        return np.sort(ts[ts < duration])
    # diurnal: rate(t) = rate * (1 + 0.9 sin(2 pi t / day)), by thinning
    cand = np.sort(rng.uniform(0, duration, rng.poisson(1.9 * spec.rate * duration)))
    keep = rng.uniform(0, 1.9, len(cand)) < 1 + 0.9 * np.sin(2 * np.pi * cand / 86400)
    return cand[keep]


def _text(rng: np.random.Generator, n_chars: int) -> str:
    words = rng.choice(len(_WORDS), size=n_chars // 4 + 8)
    out = " ".join(_WORDS[i] for i in words)
    while len(out) < n_chars:
        out += " " + out
    return out[:n_chars]


def _bust_value(kind: str, t_abs: float, counter: int, rng: np.random.Generator) -> str:
    if kind == "timestamp":
        return "Current time: " + datetime.fromtimestamp(t_abs, UTC).isoformat(timespec="milliseconds") + "\n"
    if kind == "epoch":
        return f"Generated at {int(t_abs)}\n"
    if kind == "uuid":
        return f"Request ID: {uuid_mod.UUID(bytes=rng.bytes(16), version=4)}\n"
    if kind == "hex_id":
        return f"trace={rng.bytes(8).hex()}\n"
    return f"Request number {counter}\n"


@paused_gc()  # a context manager used as a decorator: no cyclic GC passes while it runs
def synthesize(
    out: str | Path,
    endpoints: list[EndpointSpec],
    *,
    requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    start_ts: float = 1_764_000_000.0,
    tokenizer: str = "bytes",
    progress: Callable[[int], None] | None = None,
) -> SynthResult:
    """Write a trace to ``out`` (JSONL; ``.gz`` compresses) and return what was planted.

    Give ``requests`` (the duration follows from the total rate) or ``duration_s``. Content is a
    function of (seed, spec), so two runs with the same arguments give the same bytes.
    """
    if not endpoints:
        raise ValueError("give at least one endpoint spec")
    total_rate = sum(e.rate for e in endpoints)
    if duration_s is None:
        if requests is None or total_rate <= 0:
            raise ValueError("give requests (with a positive total rate) or duration_s")
        duration_s = requests / total_rate
    tok = load_tokenizer(tokenizer)
    enc = tok.encode
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.unlink(missing_ok=True)

    events: list[tuple[float, int]] = []
    for ei, spec in enumerate(endpoints):
        ts = _arrivals(spec, duration_s, np.random.default_rng([seed, ei]))
        events.extend((float(t), ei) for t in ts)
    events.sort()
    if requests is not None:
        events = events[:requests]

    planted: list[dict[str, Any]] = []
    header = {
        "tokenizer": tok.name if tok.name != "hf" else tokenizer,
        "generator": "prefixcache trace synth",
        "seed": seed,
        "start_ts": start_ts,
        "duration_s": duration_s,
        "endpoints": [asdict(e) for e in endpoints],
        "planted": planted,
    }
    # Segments: each endpoint's system prompt per version, split in two for mid-prompt busting.
    versions: list[list[tuple[str, str, int]]] = []  # [endpoint][version] -> (head id, tail id, head len)
    seg_lines: list[tuple[str, list[int]]] = []
    for ei, spec in enumerate(endpoints):
        vs = []
        for v in range(len(spec.deploys) + 1):
            srng = np.random.default_rng([seed, ei, v, 7])
            text = f"You are the {spec.name} assistant (prompt v{v}). " + _text(srng, spec.system * 5)
            ids = enc(text)[: spec.system]
            cut = {"top": 0, "middle": len(ids) // 2, "bottom": len(ids)}[spec.bust_at]
            head, tail = f"{spec.name}-v{v}-a", f"{spec.name}-v{v}-b"
            seg_lines.append((head, ids[:cut]))
            seg_lines.append((tail, ids[cut:]))
            vs.append((head, tail, cut))
        versions.append(vs)
        for kind in spec.bust.split("+") if spec.bust else ():
            planted.append({"endpoint": spec.name, "kind": kind, "at": spec.bust_at, "start_token": None})

    # Planted positions go in the header, so compute them first: the label before the value is
    # constant ("Current time: "), the value starts right after it.
    # Stacked values follow one another: each starts after the whole of the ones above it.
    above: dict[str, int] = {}
    for p in planted:
        ei = [e.name for e in endpoints].index(p["endpoint"])
        value = _bust_value(p["kind"], start_ts, 0, rng)
        label, _ = _split_value(value)
        offset = above.get(p["endpoint"], versions[ei][0][2])
        p["start_token"] = offset + len(enc(label))
        if p["kind"] == "counter":  # the first request's counter, 1001 (its width)
            value = _bust_value(p["kind"], start_ts, 1001, rng)
        above[p["endpoint"]] = offset + len(enc(value))
    counters = [0] * len(endpoints)
    convs: list[dict[str, Any] | None] = [None] * len(endpoints)
    r = np.random.default_rng([seed, 11])
    deploys = [np.asarray(e.deploys, dtype=np.float64) for e in endpoints]
    with TraceWriter(out, header=header, flush_every=4096) as w:
        for seg_id, ids in seg_lines:
            w.segment(seg_id, ids)
        for n, (t, ei) in enumerate(events):
            spec = endpoints[ei]
            version = int(np.searchsorted(deploys[ei], t, side="right")) if spec.deploys else 0
            head, tail, cut = versions[ei][version]
            parts: list[Any] = [head] if cut else []
            if spec.bust:
                counters[ei] += 1
                for kind in spec.bust.split("+"):
                    parts.append(enc(_bust_value(kind, start_ts + t, 1000 + counters[ei], r)))
            parts.append(tail)
            conv = convs[ei]
            user = _user_ids(r, spec.user)
            if (
                spec.turns > 1
                and conv is not None
                and conv["turn"] < conv["turns"]
                and conv["version"] == version
            ):
                history = conv["history"] + [user]
                conv["turn"] += 1
            else:
                history = [user]
                turns = int(r.integers(2, 2 * spec.turns)) if spec.turns > 1 else 1
                conv = {"turn": 1, "turns": turns, "version": version}
            out_n = max(1, int(r.poisson(spec.output)))
            conv["history"] = history + [_user_ids(r, min(out_n, 96))]
            convs[ei] = conv if spec.turns > 1 else None
            w.request(
                start_ts + t,
                tenant=spec.tenant,
                endpoint=spec.name,
                parts=parts + history,
                output_tokens=out_n,
            )
            if progress is not None and n % 10_000 == 0:
                progress(n)
    log.info("wrote %d requests over %.0f s to %s", len(events), duration_s, out)
    return SynthResult(path=out, requests=len(events), duration_s=duration_s, planted=planted)


def _split_value(text: str) -> tuple[str, str]:
    """("Current time: ", "2026-...Z\\n"): the label stays stable, the value varies."""
    i = text.find(": ")
    if i < 0:
        i = text.find("=")
        if i < 0:
            i = text.rfind(" ")
        return text[: i + 1], text[i + 1 :]
    return text[: i + 2], text[i + 2 :]


def _user_ids(rng: np.random.Generator, mean: int) -> list[int]:
    n = max(1, int(rng.poisson(mean)))
    # Lowercase letters and spaces as bytes: valid text for the byte tokenizer.
    ids = rng.integers(97, 123, n)
    ids[rng.uniform(0, 1, n) < 0.18] = 32
    return ids.tolist()
