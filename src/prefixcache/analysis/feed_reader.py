"""The reader process of a streamed :class:`~prefixcache.analysis.feed.TraceFeed`: it parses
the file, puts requests in time order within a window, computes their block keys and sends them
in batches, one pipe (and one writer thread) per consumer. See :mod:`prefixcache.analysis.feed`
for what a feed serves and why the window.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.analysis.trace.format import TOKEN_DTYPE, TraceFormatError
from prefixcache.analysis.trace.keychains import KeyChains, Walk, paused_gc
from prefixcache.analysis.trace.load import TraceBuilder
from prefixcache.analysis.trace.reader import open_binary
from prefixcache.cache import Namespace

log = logging.getLogger(__name__)

__all__ = [
    "CHUNK_LINES",
    "COLUMNS",
    "DTYPES",
    "REORDER_CHUNKS",
    "TOKEN_BYTES",
    "Batch",
    "TraceUnsorted",
    "namespace_root",
    "reader_main",
]

CHUNK_LINES = 4096  # lines the reader parses between sends
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
REORDER_CHUNKS = 4  # a line may precede requests of up to this many chunks before it

COLUMNS = (
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
DTYPES = (np.float64, np.int32, np.int32, np.int64, np.int64, np.int64, bool, np.float64, np.float64)


class TraceUnsorted(Exception):
    """A streamed trace has a line out of time order by more than the reader's window."""


def namespace_root(fingerprint: str, tenant: str) -> bytes:
    """The namespace root a tenant's keys chain from (as the server salts tenants)."""
    return Namespace.create(fingerprint, tenant=tenant, salt=f"tenant:{tenant}").root


@dataclass(slots=True)
class Batch:
    """One message from the reader: requests in time order, with what they need."""

    position: int  # bytes of the file read so far
    columns: tuple[np.ndarray, ...]  # COLUMNS
    parts: list[tuple[int, ...]]
    seg_data: bytes  # new segments' tokens, end to end
    seg_len: list[int]
    tenants: list[str]  # new names, in id order
    endpoints: list[str]
    header: dict[str, Any] | None
    walk: Walk


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


def reader_main(
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
    b = TraceBuilder(tokenizer)
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
    with open_binary(path) as fh:
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
            cols = [np.asarray(v, dtype=dt) for v, dt in zip(built, DTYPES, strict=True)]
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
                batch = Batch(
                    raw.tell(), tuple(cols), parts, seg_data, seg_len, tenants, endpoints, header, walk
                )
                send("batch", batch)
            if eof:
                break
    if not n_sent:
        raise TraceFormatError(f"{path}: no request lines; is this a prefixcache trace (JSONL, v1)?")
    send("end", tokenizer or b.header.get("tokenizer"))
