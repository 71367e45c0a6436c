"""Request traces: the JSONL format (version 1), a writer, a reader and a columnar loader.

Format (one JSON object per line, UTF-8; unknown fields are ignored, so it can grow):

* Request lines (``"type"`` absent or ``"request"``)::

    {"v": 1, "ts": 1764412800.25,          # seconds (any origin; only differences matter)
     "tenant": "acme",                      # optional, default "default"
     "endpoint": "support-bot",             # optional, default "default"
     # the prompt, one of (first present wins):
     "tokens": [1, 2, 3],                   # token ids
     "parts": ["sys-v1", [17, 42]],         # segment refs (str) and literal token runs (list)
     "prompt": "text",                      # raw text, tokenized on load
     "messages": [{"role": "user", "content": "hi"}],  # OpenAI/Anthropic shape, rendered + tokenized
     "block_keys": ["9f2c...", ...],        # hex chained block keys only (privacy mode), with
     "block_size": 16, "prompt_tokens": 812,  # the block size and the prompt length
     # optional measurements (what the server saw):
     "cached_tokens": 768, "cache_write_tokens": 32, "ttft_s": 0.41, "output_tokens": 120,
     "ttl": 300}                            # the TTL the request asked for (seconds)

* Segment lines define a named token run that later ``parts`` refer to (synthetic traces use them
  so a shared system prompt is written, stored and hashed once)::

    {"v": 1, "type": "segment", "id": "sys-v1", "tokens": [...]}

* An optional header line: ``{"v": 1, "type": "header", "tokenizer": "bytes", ...}``; its
  ``tokenizer`` names the tokenizer that produced the token ids (decoding for the audit's span
  classification uses it unless ``--tokenizer`` says otherwise).

A segment must appear before the first request that refers to it. Lines with ``"v"`` other than
1 are rejected with an error naming the line.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.keychains import paused_gc
from prefixcache.analysis.tokenize import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    render_messages,
)

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION", "ByteTokenizer", "HFTokenizer", "Tokenizer", "Trace", "TraceFormatError", "TraceWriter",
    "count_lines", "iter_lines", "load_tokenizer", "load_trace", "render_messages",
]

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint32


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


# ---------------------------------------------------------------------------------- writing
class TraceWriter:
    """Appends trace lines to a file (``.gz`` compresses). Thread-safe; flushes every line
    unless ``flush_every`` says otherwise. Use as a context manager or call :meth:`close`."""

    def __init__(self, path: str | Path, *, header: dict[str, Any] | None = None, flush_every: int = 1) -> None:
        self.path = Path(path)
        self._fh: io.TextIOBase = (
            gzip.open(self.path, "at", encoding="utf-8") if self.path.suffix == ".gz" else open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        )
        self._lock = threading.Lock()
        self._flush_every = max(1, flush_every)
        self._n = 0
        if header is not None:
            self._write({"v": FORMAT_VERSION, "type": "header", **header})

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            self._fh.write(line)
            self._n += 1
            if self._n % self._flush_every == 0:
                self._fh.flush()

    def segment(self, seg_id: str, tokens: list[int] | np.ndarray) -> None:
        self._write({"v": FORMAT_VERSION, "type": "segment", "id": seg_id, "tokens": [int(t) for t in tokens]})

    def request(self, ts: float, **fields: Any) -> None:
        """One request line. ``fields`` as in the module docstring; None values are dropped."""
        obj: dict[str, Any] = {"v": FORMAT_VERSION, "ts": round(float(ts), 6)}
        for k, val in fields.items():
            if val is None:
                continue
            if isinstance(val, np.ndarray):
                val = val.tolist()
            elif k == "block_keys":
                val = [b.hex() if isinstance(b, bytes | bytearray) else str(b) for b in val]
            obj[k] = val
        self._write(obj)

    def close(self) -> None:
        with self._lock:
            self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------- reading
def iter_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, parsed object) for each non-blank line. Raises TraceFormatError."""
    p = Path(path)
    opener: Callable[..., Any] = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as fh:
        loads = json.loads
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{p}:{lineno}: not JSON ({exc.msg}); is this a JSONL trace?") from None
            v = obj.get("v", FORMAT_VERSION)
            if v != FORMAT_VERSION:
                raise TraceFormatError(f"{p}:{lineno}: trace format v{v}; this version reads v{FORMAT_VERSION}")
            yield lineno, obj


@dataclass(slots=True)
class Trace:
    """A trace in columns. Request ``i``'s prompt is ``concat(segments[j] for j in parts[i])``.

    Segments are interned: identical token runs share one id, so shared system prompts are
    stored (and hashed, by the audit) once. ``has_cached[i]`` says whether ``cached_tokens[i]``
    was measured; ``ttft_s`` is NaN where unknown.
    """

    ts: np.ndarray  # float64 [n], sorted
    tenant: np.ndarray  # int32 [n] -> tenants
    endpoint: np.ndarray  # int32 [n] -> endpoints
    parts: list[tuple[int, ...]]
    segments: list[np.ndarray]  # uint32 token runs
    prompt_tokens: np.ndarray  # int64 [n]
    output_tokens: np.ndarray  # int64 [n]
    cached_tokens: np.ndarray  # int64 [n]
    has_cached: np.ndarray  # bool [n]
    ttft_s: np.ndarray  # float64 [n]
    ttl_s: np.ndarray  # float64 [n], NaN = the default
    tenants: list[str]
    endpoints: list[str]
    tokenizer: str | None = None
    header: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ts)

    def tokens(self, i: int) -> np.ndarray:
        """Request ``i``'s prompt token ids (uint32)."""
        p = self.parts[i]
        if len(p) == 1:
            return self.segments[p[0]]
        return np.concatenate([self.segments[j] for j in p])

    def endpoint_name(self, i: int) -> str:
        return self.endpoints[int(self.endpoint[i])]

    def tenant_name(self, i: int) -> str:
        return self.tenants[int(self.tenant[i])]


class _Builder:
    """Accumulates request lines into a :class:`Trace`, interning segments and names."""

    def __init__(self, tokenizer_name: str | None) -> None:
        self.tokenizer_name = tokenizer_name
        self._tok: Tokenizer | None = None
        self.segments: list[np.ndarray] = []
        self.seg_index: dict[bytes, int] = {}
        self.named: dict[str, int] = {}
        self.text_cache: dict[bytes, int] = {}
        self.key_ids: dict[str, int] = {}
        self.names: dict[str, dict[str, int]] = {"tenant": {}, "endpoint": {}}
        self.cols: dict[str, list[Any]] = {k: [] for k in ("ts", "tenant", "endpoint", "prompt", "out", "cached", "has", "ttft", "ttl")}
        self.parts: list[tuple[int, ...]] = []
        self.header: dict[str, Any] = {}

    def tokenizer(self) -> Tokenizer:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_name or self.header.get("tokenizer"))
        return self._tok

    def intern(self, arr: np.ndarray) -> int:
        data = arr.tobytes()
        sid = self.seg_index.get(data)
        if sid is None:
            sid = self.seg_index[data] = len(self.segments)
            self.segments.append(arr)
        return sid

    def _text(self, kind: bytes, payload: Any, render: Callable[[], str]) -> int:
        h = hashlib.blake2b(kind + json.dumps(payload, sort_keys=True).encode(), digest_size=16).digest()
        sid = self.text_cache.get(h)
        if sid is None:
            ids = self.tokenizer().encode(render())
            sid = self.text_cache[h] = self.intern(np.asarray(ids, dtype=TOKEN_DTYPE))
        return sid

    def _keys_parts(self, obj: dict[str, Any], where: str) -> tuple[int, ...]:
        # Privacy mode: stand-in tokens. Block i holds [id(key i), 0, ...]: equal chains of ids
        # are exactly equal chains of keys, so the cache sees the same sharing structure.
        bs = int(obj.get("block_size", 16))
        keys = obj["block_keys"]
        n = int(obj.get("prompt_tokens", len(keys) * bs))
        if n < len(keys) * bs:
            raise TraceFormatError(f"{where}: prompt_tokens {n} < block_keys x block_size")
        arr = np.zeros(n, dtype=TOKEN_DTYPE)
        for i, k in enumerate(keys):
            arr[i * bs] = self.key_ids.setdefault(k, len(self.key_ids) + 1)
        arr[len(keys) * bs :] = 0xFFFFFFFF  # the partial tail: never keyed
        return (self.intern(arr),)

    def add(self, lineno: int, obj: dict[str, Any], where: str) -> None:
        kind = obj.get("type", "request")
        if kind == "header":
            self.header = obj
            return
        if kind == "segment":
            self.named[str(obj["id"])] = self.intern(np.asarray(obj["tokens"], dtype=TOKEN_DTYPE))
            return
        if kind != "request":
            return
        if "ts" not in obj:
            raise TraceFormatError(f"{where}:{lineno}: a request line needs 'ts' (seconds)")
        if "tokens" in obj:
            parts: tuple[int, ...] = (self.intern(np.asarray(obj["tokens"], dtype=TOKEN_DTYPE)),)
        elif "parts" in obj:
            ps = []
            for p in obj["parts"]:
                if isinstance(p, str):
                    if p not in self.named:
                        raise TraceFormatError(f"{where}:{lineno}: segment {p!r} used before its definition line")
                    ps.append(self.named[p])
                else:
                    ps.append(self.intern(np.asarray(p, dtype=TOKEN_DTYPE)))
            parts = tuple(ps)
        elif "prompt" in obj:
            parts = (self._text(b"p", obj["prompt"], lambda: str(obj["prompt"])),)
        elif "messages" in obj:
            tok = self.tokenizer()
            render = getattr(tok, "render", None)
            msgs = obj["messages"]
            parts = (self._text(b"m", msgs, (lambda: render(msgs)) if render else (lambda: render_messages(msgs))),)
        elif "block_keys" in obj:
            parts = self._keys_parts(obj, f"{where}:{lineno}")
        else:
            raise TraceFormatError(f"{where}:{lineno}: no prompt: give tokens, parts, prompt, messages or block_keys")
        c = self.cols
        c["ts"].append(float(obj["ts"]))
        c["tenant"].append(self.names["tenant"].setdefault(str(obj.get("tenant") or "default"), len(self.names["tenant"])))
        c["endpoint"].append(
            self.names["endpoint"].setdefault(str(obj.get("endpoint") or "default"), len(self.names["endpoint"]))
        )
        n = sum(len(self.segments[j]) for j in parts)
        c["prompt"].append(n)
        c["out"].append(int(obj.get("output_tokens") or 0))
        ct = obj.get("cached_tokens")
        c["cached"].append(int(ct) if ct is not None else 0)
        c["has"].append(ct is not None)
        c["ttft"].append(float(obj["ttft_s"]) if obj.get("ttft_s") is not None else float("nan"))
        c["ttl"].append(float(obj["ttl"]) if isinstance(obj.get("ttl"), int | float) else float("nan"))
        self.parts.append(parts)

    def build(self) -> Trace:
        c = self.cols
        ts = np.asarray(c["ts"], dtype=np.float64)
        order = np.argsort(ts, kind="stable")
        sorted_already = bool(np.all(order == np.arange(len(ts))))

        def col(name: str, dtype: Any) -> np.ndarray:
            a = np.asarray(c[name], dtype=dtype)
            return a if sorted_already else a[order]

        parts = self.parts if sorted_already else [self.parts[i] for i in order]
        return Trace(
            ts=col("ts", np.float64),
            tenant=col("tenant", np.int32),
            endpoint=col("endpoint", np.int32),
            parts=parts,
            segments=self.segments,
            prompt_tokens=col("prompt", np.int64),
            output_tokens=col("out", np.int64),
            cached_tokens=col("cached", np.int64),
            has_cached=col("has", bool),
            ttft_s=col("ttft", np.float64),
            ttl_s=col("ttl", np.float64),
            tenants=list(self.names["tenant"]),
            endpoints=list(self.names["endpoint"]),
            tokenizer=self.tokenizer_name or self.header.get("tokenizer"),
            header=self.header,
        )


def load_trace(
    path: str | Path, *, tokenizer: str | None = None, progress: Callable[[int], None] | None = None
) -> Trace:
    """Read a whole trace into columns, sorted by ``ts`` (stable).

    ``tokenizer`` overrides the header's (text prompts only need one). ``progress(lines)`` is
    called every 10,000 lines. Raises :class:`TraceFormatError` naming the bad line.
    """
    b = _Builder(tokenizer)
    where = str(path)
    with paused_gc():  # a million parsed lines are a million short-lived dicts: no cycles
        for lineno, obj in iter_lines(path):
            b.add(lineno, obj, where)
            if progress is not None and lineno % 10_000 == 0:
                progress(lineno)
    if not b.parts:
        raise TraceFormatError(f"{path}: no request lines; is this a prefixcache trace (JSONL, v1)?")
    return b.build()


def count_lines(path: str | Path) -> int:
    """Lines in the file (for progress bars); cheap relative to parsing."""
    p = Path(path)
    if p.suffix == ".gz":
        return 0
    with open(p, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
