"""The one writer of trace format v1 (see :mod:`prefixcache.analysis.trace.format`): synthetic
traces, importers and the server's ``--trace-log`` all append lines through it."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from prefixcache.analysis.trace.format import FORMAT_VERSION

__all__ = ["TraceWriter"]


class TraceWriter:
    """Appends trace lines to a file (``.gz`` compresses). Thread-safe; flushes every line
    unless ``flush_every`` says otherwise. Use as a context manager or call :meth:`close`.

    ``opener`` opens the file for appending (default: ``open``, or ``gzip.open`` for ``.gz``);
    the server's trace log passes one that creates it 0600. ``ensure_ascii=False`` writes
    non-ASCII text as UTF-8 rather than ``\\u`` escapes."""

    def __init__(
        self,
        path: str | Path,
        *,
        header: dict[str, Any] | None = None,
        flush_every: int = 1,
        opener: Callable[[Path], IO[str]] | None = None,
        ensure_ascii: bool = True,
    ) -> None:
        self.path = Path(path)
        self._fh: IO[str]
        if opener is not None:
            self._fh = opener(self.path)
        elif self.path.suffix == ".gz":
            self._fh = gzip.open(self.path, "at", encoding="utf-8")  # noqa: SIM115 - closed by close()
        else:
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self._flush_every = max(1, flush_every)
        self._ensure_ascii = ensure_ascii
        self._n = 0
        if header is not None:
            self.write({"v": FORMAT_VERSION, "type": "header", **header})

    @property
    def closed(self) -> bool:
        return self._fh.closed

    def write(self, obj: dict[str, Any]) -> None:
        """One line, as given (compact JSON). Raises ``ValueError`` once closed, ``OSError`` when
        the file cannot be written."""
        line = json.dumps(obj, separators=(",", ":"), ensure_ascii=self._ensure_ascii) + "\n"
        with self._lock:
            self._fh.write(line)
            self._n += 1
            if self._n % self._flush_every == 0:
                self._fh.flush()

    def segment(self, seg_id: str, tokens: list[int] | np.ndarray) -> None:
        self.write({"v": FORMAT_VERSION, "type": "segment", "id": seg_id, "tokens": [int(t) for t in tokens]})

    def request(self, ts: float, **fields: Any) -> None:
        """One request line. ``fields`` as in :mod:`~prefixcache.analysis.trace.format`; None values
        are dropped."""
        obj: dict[str, Any] = {"v": FORMAT_VERSION, "ts": round(float(ts), 6)}
        for k, val in fields.items():
            if val is None:
                continue
            if isinstance(val, np.ndarray):
                val = val.tolist()
            elif k == "block_keys":
                val = [b.hex() if isinstance(b, bytes | bytearray) else str(b) for b in val]
            obj[k] = val
        self.write(obj)

    def close(self) -> None:
        with self._lock:
            self._fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
