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
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

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
    "FORMAT_VERSION",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "Trace",
    "TraceFormatError",
    "TraceWriter",
    "count_lines",
    "iter_lines",
    "load_tokenizer",
    "load_trace",
    "render_messages",
]

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint32


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


# ---------------------------------------------------------------------------------- writing
class TraceWriter:
    """Appends trace lines to a file (``.gz`` compresses). Thread-safe; flushes every line
    unless ``flush_every`` says otherwise. Use as a context manager or call :meth:`close`."""

    def __init__(
        self, path: str | Path, *, header: dict[str, Any] | None = None, flush_every: int = 1
    ) -> None:
        self.path = Path(path)
        self._fh: io.TextIOBase = (
            gzip.open(self.path, "at", encoding="utf-8")  # noqa: SIM115 - the writer owns the file
            if self.path.suffix == ".gz"
            else open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
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
        self._write(
            {"v": FORMAT_VERSION, "type": "segment", "id": seg_id, "tokens": [int(t) for t in tokens]}
        )

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
def _open_binary(p: Path) -> Any:
    return gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb", buffering=1 << 20)  # noqa: SIM115


def _slow_parse(p: Path | str, lineno: int, line: bytes) -> Any:
    """A line orjson rejected: blank (None), something only the stdlib reads (NaN, Infinity), a
    last line torn by a crash (None, with a warning), or a TraceFormatError naming the line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{p}:{lineno}: not UTF-8 ({exc.reason}); is this a JSONL trace?") from None
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if not line.endswith(b"\n"):  # only the last line can lack its newline: cut short
            log.warning(
                "%s:%d: the last line is cut short (the writer stopped mid-line, e.g. a crash): skipped",
                p,
                lineno,
            )
            return None
        raise TraceFormatError(f"{p}:{lineno}: not JSON ({exc.msg}); is this a JSONL trace?") from None


def _check(p: Path | str, lineno: int, obj: Any) -> None:
    if type(obj) is not dict:
        raise TraceFormatError(f"{p}:{lineno}: not a JSON object; is this a JSONL trace?")
    v = obj.get("v", FORMAT_VERSION)
    if v != FORMAT_VERSION:
        raise TraceFormatError(f"{p}:{lineno}: trace format v{v}; this version reads v{FORMAT_VERSION}")


def iter_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, parsed object) for each non-blank line. Raises TraceFormatError."""
    p = Path(path)
    loads = orjson.loads
    with _open_binary(p) as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                obj = loads(line)
            except orjson.JSONDecodeError:
                obj = _slow_parse(p, lineno, line)
                if obj is None:
                    continue
            if type(obj) is not dict or obj.get("v", FORMAT_VERSION) != FORMAT_VERSION:
                _check(p, lineno, obj)
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


# array('I') packs a token list ~3x faster than numpy; its bytes are the uint32 array's bytes.
_U32 = "I" if array("I").itemsize == 4 else "L"
_NUMBER = (int, float)
_NAN = float("nan")


def _name_id(ids: dict[str, int], raw_ids: dict[str | None, int], raw: Any) -> int:
    """A tenant or endpoint field's id (absent, null or empty: "default"); remembers str and
    null values in ``raw_ids`` so the next line with the same value is one dict lookup."""
    name = str(raw or "default")
    i = ids.get(name)
    if i is None:
        i = ids[name] = len(ids)
    if raw is None or type(raw) is str:
        raw_ids[raw] = i
    return i


class _Builder:
    """Accumulates request lines into a :class:`Trace`, interning segments and names.

    Segments are interned by their uint32 bytes (``seg_index``) and stored in one buffer
    (``seg_data``); the arrays are made once, in :meth:`build`, as views of it.
    """

    def __init__(self, tokenizer_name: str | None) -> None:
        self.tokenizer_name = tokenizer_name
        self._tok: Tokenizer | None = None
        self.seg_index: dict[bytes, int] = {}  # a run's uint32 bytes -> its id
        self.seg_len: list[int] = []
        self.seg_data = bytearray()  # every run's bytes, in id order
        self.named: dict[str, int] = {}
        self.text_cache: dict[bytes, int] = {}
        self.key_ids: dict[str, int] = {}
        self.tenants: dict[str, int] = {}
        self.endpoints: dict[str, int] = {}
        self.c_ts: list[float] = []
        self.c_tenant: list[int] = []
        self.c_endpoint: list[int] = []
        self.c_prompt: list[int] = []
        self.c_out: list[int] = []
        self.c_cached: list[int] = []
        self.c_has: list[bool] = []
        self.c_ttft: list[float] = []
        self.c_ttl: list[float] = []
        self.parts: list[tuple[int, ...]] = []
        self.header: dict[str, Any] = {}

    def tokenizer(self) -> Tokenizer:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_name or self.header.get("tokenizer"))
        return self._tok

    def intern_bytes(self, data: bytes) -> int:
        sid = self.seg_index.get(data)
        if sid is None:
            sid = self.seg_index[data] = len(self.seg_len)
            self.seg_len.append(len(data) >> 2)
            self.seg_data += data
        return sid

    def intern(self, arr: np.ndarray) -> int:
        return self.intern_bytes(np.ascontiguousarray(arr, dtype=TOKEN_DTYPE).tobytes())

    def intern_run(self, tokens: Any, where: str, lineno: int) -> int:
        """A JSON token run (a list of ints) -> segment id. (:meth:`read` inlines the list case.)"""
        if type(tokens) is list:
            try:
                return self.intern_bytes(array(_U32, tokens).tobytes())
            except (TypeError, OverflowError):
                pass
        return self.intern_odd(tokens, where, lineno)

    def intern_odd(self, tokens: Any, where: str, lineno: int) -> int:
        """A token run that is not a plain list of uint32 ints: numpy converts it, as it always
        did (floats truncate; negative or too large ids raise)."""
        arr = np.asarray(tokens, dtype=TOKEN_DTYPE)
        if arr.ndim != 1:
            raise TraceFormatError(
                f"{where}:{lineno}: a token run must be a list of token ids, not {tokens!r:.40}"
            )
        return self.intern(arr)

    def _text(self, kind: bytes, payload: Any, render: Callable[[], str]) -> int:
        h = hashlib.blake2b(kind + json.dumps(payload, sort_keys=True).encode(), digest_size=16).digest()
        sid = self.text_cache.get(h)
        if sid is None:
            ids = self.tokenizer().encode(render())
            sid = self.text_cache[h] = self.intern(np.asarray(ids, dtype=TOKEN_DTYPE))
        return sid

    def _keys_parts(self, obj: dict[str, Any], where: str) -> int:
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
        return self.intern(arr)

    def _other(self, kind: Any, lineno: int, obj: dict[str, Any], where: str) -> None:
        if kind == "header":
            self.header = obj
        elif kind == "segment":
            self.named[str(obj["id"])] = self.intern_run(obj["tokens"], where, lineno)

    def _text_or_keys(self, lineno: int, obj: dict[str, Any], where: str) -> int:
        if "prompt" in obj:
            return self._text(b"p", obj["prompt"], lambda: str(obj["prompt"]))
        if "messages" in obj:
            tok = self.tokenizer()
            render = getattr(tok, "render", None)
            msgs = obj["messages"]
            rendered = (lambda: render(msgs)) if render else (lambda: render_messages(msgs))
            return self._text(b"m", msgs, rendered)
        if "block_keys" in obj:
            return self._keys_parts(obj, f"{where}:{lineno}")
        raise TraceFormatError(
            f"{where}:{lineno}: no prompt: give tokens, parts, prompt, messages or block_keys"
        )

    def read(
        self, lines: Iterable[bytes], where: str, progress: Callable[[int], None] | None, start: int = 1
    ) -> None:
        """Parse and add every line (the first is line ``start`` of the file). The common request
        line (ts, tenant, endpoint, parts or tokens, a few numbers) stays on this loop's straight
        path, with everything it touches bound to locals; other lines and prompt kinds branch off
        to helpers."""
        loads, decode_error = orjson.loads, orjson.JSONDecodeError
        seg_index, seg_len, seg_data, named = self.seg_index, self.seg_len, self.seg_data, self.named
        pack, u32, version = array, _U32, FORMAT_VERSION
        tenants, endpoints = self.tenants, self.endpoints
        tenant_of: dict[str | None, int] = {}  # the JSON value (str or null) -> its name's id
        endpoint_of: dict[str | None, int] = {}
        add_ts, add_tenant, add_endpoint = self.c_ts.append, self.c_tenant.append, self.c_endpoint.append
        add_prompt, add_out, add_cached = self.c_prompt.append, self.c_out.append, self.c_cached.append
        add_has, add_ttft = self.c_has.append, self.c_ttft.append
        add_ttl, add_parts = self.c_ttl.append, self.parts.append
        nan, number = _NAN, _NUMBER

        for lineno, line in enumerate(lines, start):
            if progress is not None and lineno % 10_000 == 0:
                progress(lineno)
            try:
                obj = loads(line)
            except decode_error:
                obj = _slow_parse(where, lineno, line)
                if obj is None:
                    continue
            if type(obj) is not dict or obj.get("v", version) != version:
                _check(where, lineno, obj)
            if "type" in obj and obj["type"] != "request":
                self._other(obj["type"], lineno, obj, where)
                continue
            if "ts" not in obj:
                raise TraceFormatError(f"{where}:{lineno}: a request line needs 'ts' (seconds)")
            ps = []
            n = 0
            if "tokens" in obj:
                runs, refs = (obj["tokens"],), False
            elif "parts" in obj:
                runs, refs = obj["parts"], True
            else:
                runs, refs = (), False
                ps.append(self._text_or_keys(lineno, obj, where))
                n = seg_len[ps[0]]
            for run in runs:
                if type(run) is list:
                    try:
                        data = pack(u32, run).tobytes()
                    except (TypeError, OverflowError):
                        sid = self.intern_odd(run, where, lineno)  # floats and such: numpy decides
                    else:
                        sid = seg_index.get(data)
                        if sid is None:  # (intern_bytes, inlined)
                            sid = seg_index[data] = len(seg_len)
                            seg_len.append(len(run))
                            seg_data += data
                elif refs and type(run) is str:
                    sid = named.get(run)
                    if sid is None:
                        raise TraceFormatError(
                            f"{where}:{lineno}: segment {run!r} used before its definition line"
                        )
                else:
                    sid = self.intern_odd(run, where, lineno)
                ps.append(sid)
                n += seg_len[sid]
            add_parts(tuple(ps))
            add_prompt(n)
            add_ts(float(obj["ts"]))
            raw = obj.get("tenant")
            try:
                add_tenant(tenant_of[raw])
            except (KeyError, TypeError):
                add_tenant(_name_id(tenants, tenant_of, raw))
            raw = obj.get("endpoint")
            try:
                add_endpoint(endpoint_of[raw])
            except (KeyError, TypeError):
                add_endpoint(_name_id(endpoints, endpoint_of, raw))
            add_out(int(obj.get("output_tokens") or 0))
            v = obj.get("cached_tokens")
            if v is None:
                add_cached(0)
                add_has(False)
            else:
                add_cached(int(v))
                add_has(True)
            v = obj.get("ttft_s")
            add_ttft(nan if v is None else float(v))
            v = obj.get("ttl")
            add_ttl(float(v) if isinstance(v, number) else nan)

    def build_segments(self) -> list[np.ndarray]:
        """The interned runs as uint32 arrays (writable views of one buffer), in id order."""
        self.seg_index = {}
        if not self.seg_len:
            return []
        buf = np.frombuffer(self.seg_data, dtype=TOKEN_DTYPE)
        ends = np.cumsum(self.seg_len, dtype=np.int64).tolist()
        starts = [0, *ends[:-1]]
        return [buf[a:b] for a, b in zip(starts, ends, strict=True)]

    def build(self) -> Trace:
        ts = np.asarray(self.c_ts, dtype=np.float64)
        order = np.argsort(ts, kind="stable")
        sorted_already = bool(np.all(order == np.arange(len(ts))))

        def col(values: list[Any], dtype: Any) -> np.ndarray:
            a = np.asarray(values, dtype=dtype)
            return a if sorted_already else a[order]

        parts = self.parts if sorted_already else [self.parts[i] for i in order.tolist()]
        return Trace(
            ts=ts if sorted_already else ts[order],
            tenant=col(self.c_tenant, np.int32),
            endpoint=col(self.c_endpoint, np.int32),
            parts=parts,
            segments=self.build_segments(),
            prompt_tokens=col(self.c_prompt, np.int64),
            output_tokens=col(self.c_out, np.int64),
            cached_tokens=col(self.c_cached, np.int64),
            has_cached=col(self.c_has, bool),
            ttft_s=col(self.c_ttft, np.float64),
            ttl_s=col(self.c_ttl, np.float64),
            tenants=list(self.tenants),
            endpoints=list(self.endpoints),
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
    # paused_gc: a million parsed lines are a million short-lived dicts, and no cycles
    with paused_gc(), _open_binary(Path(path)) as fh:
        b.read(fh, where, progress)
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
