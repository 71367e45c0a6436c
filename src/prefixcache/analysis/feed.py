"""A trace's requests in time order, with their block keys, for the audit's and simulator's loops.

Both loops walk requests in time order and need each one's chained block keys (fingerprints:
see :mod:`~prefixcache.analysis.trace.keychains`). A :class:`TraceFeed` gives them exactly that, one
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.feed_reader import (
    CHUNK_LINES,
    DTYPES,
    REORDER_CHUNKS,
    TOKEN_BYTES,
    Batch,
    TraceUnsorted,
    namespace_root,
    reader_main,
)
from prefixcache.analysis.trace.format import TOKEN_DTYPE, TraceFormatError
from prefixcache.analysis.trace.keychains import KeyChains
from prefixcache.analysis.trace.load import Trace

log = logging.getLogger(__name__)

__all__ = ["CHUNK_LINES", "REORDER_CHUNKS", "TraceFeed", "TraceUnsorted", "can_stream", "stream"]


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
        target=reader_main,
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
            b: Batch = msg
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
            for k, dt in enumerate(DTYPES)
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
