"""A whole trace read into columns (:class:`Trace`), segments and names interned."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from prefixcache.analysis.trace.format import FORMAT_VERSION, TOKEN_DTYPE, TraceFormatError
from prefixcache.analysis.trace.keychains import paused_gc
from prefixcache.analysis.trace.reader import check_line, open_binary, parse_fallback
from prefixcache.analysis.trace.tokenize import Tokenizer, load_tokenizer, render_messages

__all__ = ["Trace", "TraceBuilder", "load_trace"]


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


class TraceBuilder:
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
                obj = parse_fallback(where, lineno, line)
                if obj is None:
                    continue
            if type(obj) is not dict or obj.get("v", version) != version:
                check_line(where, lineno, obj)
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
    b = TraceBuilder(tokenizer)
    where = str(path)
    # paused_gc: a million parsed lines are a million short-lived dicts, and no cycles
    with paused_gc(), open_binary(Path(path)) as fh:
        b.read(fh, where, progress)
    if not b.parts:
        raise TraceFormatError(f"{path}: no request lines; is this a prefixcache trace (JSONL, v1)?")
    return b.build()
