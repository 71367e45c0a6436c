"""Reading trace lines: the file opened (``.gz`` or plain), each line parsed (orjson, with a
stdlib fallback for NaN and a torn last line) and checked for the format version."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from prefixcache.analysis.trace.format import FORMAT_VERSION, TraceFormatError

log = logging.getLogger(__name__)

__all__ = ["count_lines", "iter_lines", "open_binary"]


def open_binary(p: Path) -> Any:
    return gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb", buffering=1 << 20)  # noqa: SIM115


def parse_fallback(p: Path | str, lineno: int, line: bytes) -> Any:
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


def check_line(p: Path | str, lineno: int, obj: Any) -> None:
    if type(obj) is not dict:
        raise TraceFormatError(f"{p}:{lineno}: not a JSON object; is this a JSONL trace?")
    v = obj.get("v", FORMAT_VERSION)
    if v != FORMAT_VERSION:
        raise TraceFormatError(f"{p}:{lineno}: trace format v{v}; this version reads v{FORMAT_VERSION}")


def iter_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, parsed object) for each non-blank line. Raises TraceFormatError."""
    p = Path(path)
    loads = orjson.loads
    with open_binary(p) as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                obj = loads(line)
            except orjson.JSONDecodeError:
                obj = parse_fallback(p, lineno, line)
                if obj is None:
                    continue
            if type(obj) is not dict or obj.get("v", FORMAT_VERSION) != FORMAT_VERSION:
                check_line(p, lineno, obj)
            yield lineno, obj


def count_lines(path: str | Path) -> int:
    """Lines in the file (for progress bars); cheap relative to parsing."""
    p = Path(path)
    if p.suffix == ".gz":
        return 0
    with open(p, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
