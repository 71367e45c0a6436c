"""A trace's requests in time order, with their block keys, for the audit's and simulator's loops.

Both loops walk requests in time order and need each one's chained block keys (fingerprints:
see :mod:`~prefixcache.analysis.keychains`). A :class:`TraceFeed` gives them exactly that, one
request at a time (``for i, keys in enumerate(feed)``), with the trace's columns as lists that
hold at least every request served so far. It comes from one of two sources:

* :meth:`TraceFeed.of` a loaded :class:`~prefixcache.analysis.trace.Trace`: keys are computed in
  this process, in batches.
* :func:`stream`: a forked **reader process** parses the file, puts the requests in time order,
  computes their keys and sends them in batches, one pipe per consumer, while the consumers work.
  Reading and hashing (about a third of a million-request simulation) then overlap with the
  replay instead of preceding it: the simulator's loop starts after the first few thousand lines.

What a streamed feed serves is what loading gives: :meth:`TraceFeed.trace` at the end equals
:func:`~prefixcache.analysis.trace.load_trace` of the file (same columns, same stable time order,
same segment, tenant and endpoint ids), and the keys equal :meth:`KeyChains.iter_keys`'.

Time order. ``load_trace`` sorts by ``ts`` (stable). The reader sorts within a window instead:
it holds back the requests of the last :data:`REORDER_CHUNKS` chunks of :data:`CHUNK_LINES`
lines that a later line could still precede, and sends the rest in order. A trace whose lines are
out of order by more than that (a server's trace log, written as requests finish, is out of order
by about one request's latency) raises :class:`TraceUnsorted` in the consumer, at the line that
broke the order; :func:`~prefixcache.analysis.simulate.simulate_file` and
:func:`~prefixcache.analysis.audit.audit_file` then load and sort the whole file instead.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.keychains import KeyChains, Walk, paused_gc
from prefixcache.analysis.trace import TOKEN_DTYPE, Trace, TraceFormatError, _Builder, _open_binary
from prefixcache.cache import Namespace

log = logging.getLogger(__name__)

__all__ = ["CHUNK_LINES", "REORDER_CHUNKS", "TraceFeed", "TraceUnsorted", "can_stream", "stream"]

CHUNK_LINES = 4096  # lines the reader parses between sends
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
REORDER_CHUNKS = 4  # a line may precede requests of up to this many chunks before it

_COLUMNS = (
    "ts",
    "tenant",
    "endpoint",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "has_cached",
    "ttft_s",
    "ttl_s",
)
_DTYPES = (np.float64, np.int32, np.int32, np.int64, np.int64, np.int64, bool, np.float64, np.float64)


class TraceUnsorted(Exception):
    """A streamed trace has a line out of time order by more than the reader's window."""


def namespace_root(fingerprint: str, tenant: str) -> bytes:
    """The namespace root a tenant's keys chain from (as the server salts tenants)."""
    return Namespace.create(fingerprint, tenant=tenant, salt=f"tenant:{tenant}").root


class TraceFeed:
    """Requests in time order with their keys; see the module docstring.

    Iterating yields request ``i``'s block keys (shared lists: do not mutate them) once its
    columns are in place: ``ts[i]``, ``tenant[i]``, ``endpoint[i]``, ``prompt_tokens[i]``,
    ``ttl_s[i]`` (NaN: the default), ``parts[i]`` over ``segments`` (``seg_len`` their lengths;
    ``seg_bytes``, for streams, the same tokens packed),
    ``tenants`` and ``endpoints`` (names by id). A feed is iterated once.
    """

    def __init__(self, fingerprint: str, block_size: int) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.ts: list[float] = []
        self.tenant: list[int] = []
        self.endpoint: list[int] = []
        self.prompt_tokens: list[int] = []
        self.ttl_s: list[float] = []
        self.parts: list[tuple[int, ...]] = []
        self.segments: list[np.ndarray] = []
        self.seg_len: list[int] = []
        # Streams: each segment packed (the arrays are views of these).
        self.seg_bytes: list[bytes] | None = None
        self.tenants: list[str] = []
        self.endpoints: list[str] = []
        self.position = 0  # bytes of the file read (streams), for progress bars
        self.size = 0  # the file's size (streams)
        self._trace: Trace | None = None
        self._keys: Iterator[list[bytes]] | None = None
        self._stream: _Receiver | None = None

    # ------------------------------------------------------------------ sources
    @classmethod
    def of(cls, trace: Trace, fingerprint: str, block_size: int) -> TraceFeed:
        """A loaded trace; keys computed in this process (batched, lazily)."""
        f = cls(fingerprint, block_size)
        f.ts, f.tenant, f.endpoint = trace.ts.tolist(), trace.tenant.tolist(), trace.endpoint.tolist()
        f.prompt_tokens, f.ttl_s = trace.prompt_tokens.tolist(), trace.ttl_s.tolist()
        f.parts, f.segments = trace.parts, trace.segments
        f.seg_len = [len(s) for s in trace.segments]
        f.tenants, f.endpoints = list(trace.tenants), list(trace.endpoints)
        f._trace = trace
        roots = [namespace_root(fingerprint, t) for t in trace.tenants]
        chains = KeyChains(trace.segments, block_size, hasher="fingerprint")
        f._keys = chains.iter_keys(zip(map(roots.__getitem__, f.tenant), f.parts, strict=True))
        return f

    @property
    def complete(self) -> bool:
        """Whether every request is already in the columns (a loaded trace)."""
        return self._trace is not None and self._stream is None

    def __iter__(self) -> Iterator[list[bytes]]:
        if self._stream is not None:
            return self._stream.serve(self)
        if self._keys is None:
            raise RuntimeError("a TraceFeed is iterated once")
        keys, self._keys = self._keys, None
        return keys

    def tokens(self, i: int) -> np.ndarray:
        """Request ``i``'s prompt token ids (uint32)."""
        p = self.parts[i]
        if len(p) == 1:
            return self.segments[p[0]]
        return np.concatenate([self.segments[j] for j in p])

    def trace(self) -> Trace:
        """The whole trace as columns (for a stream: once iterated to the end)."""
        if self._trace is None:
            if self._stream is None or not self._stream.done:
                raise RuntimeError("the feed has not been read to the end")
            self._trace = self._stream.build(self)
        return self._trace

    def close(self) -> None:
        """Stop the reader process (streams); safe to call twice."""
        if self._stream is not None:
            self._stream.close()

    def detach(self) -> None:
        """Close this process's end of the pipe only (after forking the process that reads it)."""
        if self._stream is not None:
            self._stream.conn.close()

    def __enter__(self) -> TraceFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------- streaming
def can_stream() -> bool:
    """Whether this platform can fork a reader process."""
    return "fork" in mp.get_all_start_methods()


def stream(
    path: str | Path, *, fingerprint: str, block_size: int, tokenizer: str | None = None, consumers: int = 1
) -> list[TraceFeed]:
    """Fork a reader process for ``path`` and return one feed per consumer (each a pipe). Every
    consumer must read its feed to the end or close it: the reader waits for the slowest one. To
    give a feed to a forked process, fork it after this call and close the feed here
    (:meth:`TraceFeed.close` on the parent's copy only closes its pipe end).

    Raises OSError where the reader cannot be started (the caller loads the file instead).
    """
    p = Path(path)
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(consumers)]
    proc = ctx.Process(
        target=_reader_main,
        name="prefixcache-trace-reader",
        daemon=True,
        args=(p, tokenizer, block_size, fingerprint, pipes),
    )
    try:
        proc.start()
    except AssertionError as exc:  # inside a daemon process: no children
        for r, w in pipes:
            r.close()
            w.close()
        raise OSError(str(exc)) from None
    feeds = []
    size = p.stat().st_size
    for r, w in pipes:
        w.close()
        f = TraceFeed(fingerprint, block_size)
        f.size = size
        f.seg_bytes = []
        f._stream = _Receiver(r, proc)
        feeds.append(f)
    return feeds


@dataclass(slots=True)
class _Batch:
    """One message from the reader: requests in time order, with what they need."""

    position: int  # bytes of the file read so far
    columns: tuple[np.ndarray, ...]  # _COLUMNS
    parts: list[tuple[int, ...]]
    seg_data: bytes  # new segments' tokens, end to end
    seg_len: list[int]
    tenants: list[str]  # new names, in id order
    endpoints: list[str]
    header: dict[str, Any] | None
    walk: Walk


class _Receiver:
    """A consumer's end of the reader's pipe: unpacks batches into a feed's columns and keys."""

    def __init__(self, conn: Any, proc: Any) -> None:
        self.conn, self.proc = conn, proc
        self.done = False
        self.columns: list[tuple[np.ndarray, ...]] = []
        self.header: dict[str, Any] = {}
        self.tokenizer: str | None = None

    def recv(self) -> tuple[str, Any]:
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            code = None
            if _is_parent(self.proc):
                self.proc.join(5)
                code = self.proc.exitcode
            raise RuntimeError(
                f"the trace reader process stopped without finishing (exit code {code})"
            ) from None
        return pickle.loads(data)

    def serve(self, feed: TraceFeed) -> Iterator[list[bytes]]:
        keys_of: dict[int, list[bytes]] = {-1: []}
        extend_cols = (
            feed.ts.extend,
            feed.tenant.extend,
            feed.endpoint.extend,
            feed.prompt_tokens.extend,
            feed.ttl_s.extend,
        )
        while True:
            kind, msg = self.recv()
            if kind == "end":
                self.tokenizer = msg
                self.done = True
                self.close()
                return
            if kind == "error":
                self.close()
                raise TraceFormatError(msg)
            if kind == "unsorted":
                self.close()
                raise TraceUnsorted(msg)
            b: _Batch = msg
            feed.position = b.position
            if b.header is not None:
                self.header = b.header
            feed.tenants.extend(b.tenants)
            feed.endpoints.extend(b.endpoints)
            if b.seg_len:
                # One bytes object per segment, and the uint32 array as a view of it (no copy).
                data = b.seg_data
                ends = (np.cumsum(b.seg_len) * TOKEN_BYTES).tolist()
                packed = [data[a:z] for a, z in zip([0, *ends[:-1]], ends, strict=True)]
                feed.seg_bytes.extend(packed)
                feed.segments.extend([np.frombuffer(x, dtype=TOKEN_DTYPE) for x in packed])
                feed.seg_len.extend(b.seg_len)
            c = b.columns
            self.columns.append(c)
            for add, col in zip(extend_cols, (c[0], c[1], c[2], c[3], c[8]), strict=True):
                add(col.tolist())
            feed.parts.extend(b.parts)
            w = b.walk
            if w.node:
                new = np.frombuffer(b"".join(w.keys), dtype="V16").tolist()  # 16-byte bytes objects
                pos = 0
                for nid, pid, q in zip(w.node, w.parent, w.count, strict=True):
                    if q:
                        keys_of[nid] = keys_of[pid] + new[pos : pos + q]
                        pos += q
                    else:
                        keys_of[nid] = keys_of[pid]
            yield from [keys_of[f] for f in w.final]
            for d in w.dropped:
                keys_of.pop(d, None)

    def build(self, feed: TraceFeed) -> Trace:
        cols = [
            np.concatenate([c[k] for c in self.columns]) if self.columns else np.zeros(0, dtype=dt)
            for k, dt in enumerate(_DTYPES)
        ]
        self.columns = []
        return Trace(
            ts=cols[0],
            tenant=cols[1],
            endpoint=cols[2],
            parts=feed.parts,
            segments=feed.segments,
            prompt_tokens=cols[3],
            output_tokens=cols[4],
            cached_tokens=cols[5],
            has_cached=cols[6],
            ttft_s=cols[7],
            ttl_s=cols[8],
            tenants=list(feed.tenants),
            endpoints=list(feed.endpoints),
            tokenizer=self.tokenizer,
            header=self.header,
        )

    def close(self) -> None:
        self.conn.close()
        if _is_parent(self.proc) and not self.done and self.proc.is_alive():
            self.proc.terminate()
        if _is_parent(self.proc):
            self.proc.join(5)


def _is_parent(proc: Any) -> bool:
    """Whether this process started ``proc`` (a forked consumer holds a copy it cannot join)."""
    return getattr(proc, "_parent_pid", None) == os.getpid()


# ---------------------------------------------------------------------------------- the reader
_QUEUED = 16  # messages queued per consumer before the reader waits for it


class _Writer(threading.Thread):
    """Writes one consumer's messages, so that a slow consumer delays neither the reader nor the
    others (beyond its queue). A consumer that went away is skipped from then on."""

    def __init__(self, conn: Any) -> None:
        super().__init__(daemon=True)
        self.conn = conn
        self.queue: queue.Queue[bytes | None] = queue.Queue(_QUEUED)
        self.gone = False

    def run(self) -> None:
        while (data := self.queue.get()) is not None:
            if not self.gone:
                try:
                    self.conn.send_bytes(data)
                except OSError:  # BrokenPipeError: the consumer closed its end
                    self.gone = True
        self.conn.close()


def _reader_main(
    path: Path, tokenizer: str | None, block_size: int, fingerprint: str, pipes: list[Any]
) -> None:
    for r, _ in pipes:
        r.close()
    writers = [_Writer(w) for _, w in pipes]
    for w in writers:
        w.start()

    def send(kind: str, msg: Any) -> None:
        if all(w.gone for w in writers):
            raise BrokenPipeError("every consumer went away")
        data = pickle.dumps((kind, msg), protocol=pickle.HIGHEST_PROTOCOL)
        for w in writers:
            w.queue.put(data)

    try:
        with paused_gc():
            _read(path, tokenizer, block_size, fingerprint, send)
    except TraceFormatError as exc:
        send("error", str(exc))
    except TraceUnsorted as exc:
        send("unsorted", str(exc))
    except BrokenPipeError:  # every consumer went away: nothing left to do
        pass
    except Exception as exc:  # noqa: BLE001 - reported to the consumers, which raise it
        log.exception("trace reader failed")
        send("error", f"{path}: cannot read the trace ({type(exc).__name__}: {exc})")
    finally:
        for w in writers:
            w.queue.put(None)
        for w in writers:
            w.join()


def _read(
    path: Path, tokenizer: str | None, block_size: int, fingerprint: str, send: Callable[[str, Any], None]
) -> None:
    b = _Builder(tokenizer)
    where = str(path)
    segments: list[np.ndarray] = []
    chains = KeyChains(segments, block_size, hasher="fingerprint")
    roots: list[bytes] = []
    sent_segs = sent_tenants = sent_endpoints = 0
    header_sent: dict[str, Any] | None = None
    held: tuple[list[np.ndarray], list[tuple[int, ...]]] | None = None  # sorted by ts
    mins: deque[float] = deque(maxlen=REORDER_CHUNKS)
    sent_ts = -np.inf  # the latest ts sent
    n_sent = 0
    lineno = 0
    with _open_binary(path) as fh:
        raw = getattr(fh, "fileobj", None) or fh  # a gzip file reports its compressed position
        lines = iter(fh)
        while True:
            chunk = list(islice(lines, CHUNK_LINES))
            b.read(chunk, where, None, start=lineno + 1)
            first_line = lineno + 1
            lineno += len(chunk)
            eof = len(chunk) < CHUNK_LINES
            built = (
                b.c_ts,
                b.c_tenant,
                b.c_endpoint,
                b.c_prompt,
                b.c_out,
                b.c_cached,
                b.c_has,
                b.c_ttft,
                b.c_ttl,
            )
            cols = [np.asarray(v, dtype=dt) for v, dt in zip(built, _DTYPES, strict=True)]
            parts = b.parts
            b.c_ts, b.c_tenant, b.c_endpoint, b.c_prompt, b.c_out = [], [], [], [], []
            b.c_cached, b.c_has, b.c_ttft, b.c_ttl, b.parts = [], [], [], [], []
            if len(cols[0]):
                lo = float(cols[0].min())
                if lo < sent_ts:
                    at = first_line + int(np.argmax(cols[0] < sent_ts))
                    raise TraceUnsorted(
                        f"{path}: the request near line {at} is older than one already sent "
                        f"(the reader orders requests within about "
                        f"{CHUNK_LINES * (REORDER_CHUNKS - 1):,} lines)"
                    )
                mins.append(lo)
            if held is not None:
                cols = [np.concatenate((h, c)) for h, c in zip(held[0], cols, strict=True)]
                parts = held[1] + parts
            order = np.argsort(cols[0], kind="stable")
            k = len(order) if eof else int(np.searchsorted(cols[0][order], min(mins), side="right"))
            if k < len(order) or not np.array_equal(order[:k], np.arange(k)):
                keep = order[k:]
                held = ([c[keep] for c in cols], [parts[j] for j in keep.tolist()])
                emit = order[:k]
                cols = [c[emit] for c in cols]
                parts = [parts[j] for j in emit.tolist()]
            else:
                held = None
            # New names and segments (everything interned so far: emitted requests may use them).
            tenants = list(b.tenants)[sent_tenants:]
            endpoints = list(b.endpoints)[sent_endpoints:]
            sent_tenants += len(tenants)
            sent_endpoints += len(endpoints)
            roots.extend(namespace_root(fingerprint, t) for t in tenants)
            seg_len = b.seg_len[sent_segs:]
            seg_data = bytes(b.seg_data)
            b.seg_data.clear()  # (the interning dict keeps its own copies of the bytes)
            if seg_len:
                buf = np.frombuffer(seg_data, dtype=TOKEN_DTYPE)
                ends = np.cumsum(seg_len).tolist()
                segments.extend([buf[a:z] for a, z in zip([0, *ends[:-1]], ends, strict=True)])
            sent_segs += len(seg_len)
            header = b.header if b.header and b.header is not header_sent else None
            if header is not None:
                header_sent = b.header
            if len(cols[0]):
                sent_ts = float(cols[0][-1])
            walk = chains.walk(zip(map(roots.__getitem__, cols[1].tolist()), parts, strict=True))
            n_sent += len(parts)
            if len(parts) or seg_len or tenants or endpoints or header is not None:
                batch = _Batch(
                    raw.tell(), tuple(cols), parts, seg_data, seg_len, tenants, endpoints, header, walk
                )
                send("batch", batch)
            if eof:
                break
    if not n_sent:
        raise TraceFormatError(f"{path}: no request lines; is this a prefixcache trace (JSONL, v1)?")
    send("end", tokenizer or b.header.get("tokenizer"))
