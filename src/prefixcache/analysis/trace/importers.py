"""``prefixcache trace import``: public and foreign traces into the ops tools' format (v1).

Formats (``--from``):

* ``mooncake``: the Mooncake FAST'25 traces (``conversation_trace.jsonl`` and friends): one
  object per line with ``timestamp`` (milliseconds since the first request), ``input_length``,
  ``output_length`` and ``hash_ids``, one id per 512-token block (the last may be partial).
* ``qwen-bailian``: Alibaba's Qwen-Bailian usage traces (``qwen_traceA_blksz_16.jsonl`` ...):
  ``chat_id``, ``parent_chat_id`` (-1 for a root), ``timestamp`` (seconds), ``input_length``,
  ``output_length``, ``type`` (text, search, image, file: the endpoint here), ``turn`` and
  ``hash_ids``, one salted hash per 16-token block.
* ``openai`` / ``anthropic``: request bodies, one per line (a Chat Completions body with
  ``messages``; a Messages body with ``system``, ``messages`` and ``tools``), optionally wrapped as
  ``{"body": {...}, ...}``, with a timestamp field (``--timestamp-field``, default ``timestamp``:
  seconds, or an ISO 8601 string). A line without it is an error unless ``--interval-ms`` spaces
  the requests evenly. The prompt text is kept (``messages``; tools rendered as a JSON system
  message first, where the server renders them), so the audit decodes its spans.
* ``trace-log``: the server's own ``--trace-log`` (already this format, written as requests
  finish, so out of time order): sorted by ``ts``.

``hash_ids`` become chained ``block_keys`` (key i is a hash of key i-1 and id i, so equal keys
mean equal prefixes whether or not the source's ids were chained) for the full blocks only
(``input_length // block``: the cache stores only full blocks), with ``block_size`` and
``prompt_tokens``. Such traces carry no token text: the header says ``"token_text": false``,
and the audit then lists the findings it cannot make. The header also records the block size,
which ``audit`` and ``simulate`` take as their default ``--block-size``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prefixcache.analysis.trace.format import FORMAT_VERSION, TraceFormatError
from prefixcache.analysis.trace.reader import iter_lines, open_binary

FORMATS = ("mooncake", "qwen-bailian", "openai", "anthropic", "trace-log")
BLOCK_SIZES = {"mooncake": 512, "qwen-bailian": 16}
ROUTES = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}


@dataclass(slots=True)
class ImportResult:
    requests: int
    block_size: int | None
    token_text: bool


def import_trace(
    fmt: str,
    src: str | Path,
    dst: str | Path,
    *,
    timestamp_field: str = "timestamp",
    interval_ms: float | None = None,
    tenant: str | None = None,
    endpoint: str | None = None,
    tokenizer: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ImportResult:
    """Convert ``src`` (format ``fmt``) into a v1 trace at ``dst`` (overwritten), requests sorted
    by time. ``tenant`` / ``endpoint`` label every request (defaults: the format's own labels).
    ``progress(bytes_read, total_bytes)``. Raises TraceFormatError naming the file and line."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    header: dict[str, Any] = {"v": FORMAT_VERSION, "type": "header", "source": fmt}
    if tokenizer is not None:
        header["tokenizer"] = tokenizer
    if fmt in BLOCK_SIZES:
        header.update(block_size=BLOCK_SIZES[fmt], token_text=False)
    requests = _requests(
        fmt, src, header, _lines(src, progress), timestamp_field, interval_ms, tenant, endpoint
    )
    # The requests go to a scratch file as they are converted (a large trace is never held in
    # memory), then behind the header (known only at the end) into ``dst``: copied when already
    # in time order (the public traces are), else sorted (stable) in memory.
    scratch = dst.with_name(dst.name + ".part")
    count, ordered, last = 0, True, float("-inf")
    try:
        with open(scratch, "w", encoding="utf-8") as part:
            for r in requests:
                ts = r["ts"]
                ordered = ordered and ts >= last
                last = ts if ts > last else last
                part.write(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n")
                count += 1
        if not count:
            raise TraceFormatError(f"{src}: no requests found; is this a {fmt} trace?")
        with open(scratch, "rb") as part, open(dst, "wb") as out:
            out.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
            if ordered:
                shutil.copyfileobj(part, out)
            else:
                lines = part.readlines()
                keys = [json.loads(line)["ts"] for line in lines]
                for i in sorted(range(len(lines)), key=keys.__getitem__):
                    out.write(lines[i])
    finally:
        scratch.unlink(missing_ok=True)
    return ImportResult(count, header.get("block_size"), header.get("token_text", True))


def _requests(
    fmt: str,
    src: Path,
    header: dict[str, Any],
    lines: Iterator[tuple[int, dict[str, Any]]],
    timestamp_field: str,
    interval_ms: float | None,
    tenant: str | None,
    endpoint: str | None,
) -> Iterator[dict[str, Any]]:
    """The converted request lines, in file order; a trace log's header lines go into ``header``."""
    if fmt in BLOCK_SIZES:
        for n, obj in lines:
            yield _hash_ids_line(fmt, src, n, obj, BLOCK_SIZES[fmt], tenant, endpoint)
    elif fmt in ROUTES:
        for k, (n, obj) in enumerate(lines):
            yield _body_line(fmt, src, k, n, obj, timestamp_field, interval_ms, tenant, endpoint)
    else:
        for n, obj in lines:
            kind = obj.get("type", "request")
            if kind == "header":
                header.update({k: v for k, v in obj.items() if k not in ("type", "source")})
            elif kind == "request":
                if (
                    not isinstance(obj.get("ts"), int | float)
                    or obj.get("v", FORMAT_VERSION) != FORMAT_VERSION
                ):
                    raise TraceFormatError(
                        f"{src}:{n}: not a v1 trace-log request line (needs a numeric 'ts')"
                    )
                if "block_keys" in obj:
                    header["token_text"] = False
                    header.setdefault("block_size", int(obj.get("block_size", 16)))
                yield obj
            else:
                raise TraceFormatError(f"{src}:{n}: a {kind!r} line: a server trace log has none")


def _lines(src: Path, progress: Callable[[int, int], None] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line, with progress in bytes read."""
    total = src.stat().st_size if src.suffix != ".gz" else 0  # (a .gz: bytes read are not its size)
    with open_binary(src) as fh:
        for lineno, raw in enumerate(fh, 1):
            if progress is not None and lineno % 10_000 == 0:
                progress(fh.tell() if hasattr(fh, "tell") else 0, total)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TraceFormatError(f"{src}:{lineno}: not JSON ({exc}); is this a JSONL file?") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{src}:{lineno}: not a JSON object")
            yield lineno, obj
    if progress is not None:
        progress(total, total)


def _need(src: Path, lineno: int, obj: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceFormatError(f"{src}:{lineno}: needs {name!r} ({_kind_name(kind)}), got {value!r:.60}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def chained_keys(ids: list[Any], root: bytes) -> list[str]:
    """Chained 16-byte keys (hex) of a list of block ids: key i = blake2b(key i-1 || id i)."""
    keys = []
    prev = root
    for block_id in ids:
        prev = hashlib.blake2b(prev + str(block_id).encode(), digest_size=16).digest()
        keys.append(prev.hex())
    return keys


def _hash_ids_line(
    fmt: str,
    src: Path,
    lineno: int,
    obj: dict[str, Any],
    block: int,
    tenant: str | None,
    endpoint: str | None,
) -> dict[str, Any]:
    ts = _need(src, lineno, obj, "timestamp", (int, float))
    n = _need(src, lineno, obj, "input_length", int)
    out_n = obj.get("output_length", 0)
    ids = _need(src, lineno, obj, "hash_ids", list)
    if n < 0:
        raise TraceFormatError(f"{src}:{lineno}: input_length {n} < 0")
    full = min(len(ids), n // block)  # only full blocks are cached
    line: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "ts": ts / 1000.0 if fmt == "mooncake" else float(ts),
        "tenant": tenant or "default",
        "endpoint": endpoint or (str(obj.get("type") or "default") if fmt == "qwen-bailian" else "default"),
        "block_keys": chained_keys(ids[:full], fmt.encode()),
        "block_size": block,
        "prompt_tokens": n,
        "output_tokens": int(out_n) if isinstance(out_n, int | float) else 0,
    }
    return line


def _body_line(
    fmt: str,
    src: Path,
    index: int,
    lineno: int,
    obj: dict[str, Any],
    timestamp_field: str,
    interval_ms: float | None,
    tenant: str | None,
    endpoint: str | None,
) -> dict[str, Any]:
    body = obj["body"] if isinstance(obj.get("body"), dict) else obj
    raw_ts = obj.get(timestamp_field, body.get(timestamp_field))
    if raw_ts is None:
        if interval_ms is None:
            raise TraceFormatError(
                f"{src}:{lineno}: no timestamp field {timestamp_field!r}; name the field that holds "
                "one with --timestamp-field, or space the requests evenly with --interval-ms"
            )
        ts = index * interval_ms / 1000.0
    else:
        ts = _seconds(src, lineno, raw_ts, timestamp_field)
    messages = _need(src, lineno, body, "messages", list)
    if fmt == "anthropic" and body.get("system") is not None:
        messages = [{"role": "system", "content": body["system"]}, *messages]
    if body.get("tools"):
        tools = json.dumps(body["tools"], separators=(",", ":"), ensure_ascii=False)
        messages = [{"role": "system", "content": f"Tools: {tools}"}, *messages]
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise TraceFormatError(f"{src}:{lineno}: each message needs a 'role' and 'content'")
    line: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "ts": ts,
        "tenant": tenant or str(obj.get("tenant") or "default"),
        "endpoint": endpoint or str(obj.get("endpoint") or ROUTES[fmt]),
        "messages": messages,
    }
    max_out = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(max_out, int):
        line["output_tokens"] = max_out
    return line


def _seconds(src: Path, lineno: int, value: Any, name: str) -> float:
    """A timestamp: a number of seconds, or an ISO 8601 string."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise TraceFormatError(f"{src}:{lineno}: {name!r} is {value!r:.40}: give seconds or an ISO 8601 time")


def header_of(path: str | Path) -> dict[str, Any]:
    """The trace's header line ({} when its first line is not one)."""
    try:
        for _, obj in iter_lines(path):
            return obj if obj.get("type") == "header" else {}
    except (OSError, TraceFormatError):
        return {}
    return {}


def block_size_for(path: str | Path, given: int | None, default: int = 16) -> int:
    """The block size to audit or simulate ``path`` with: ``given``, else its header's, else
    ``default``. ValueError when ``given`` contradicts a header that fixes it (a trace of block
    hashes: a smaller block would treat every partial tail as equal)."""
    header = header_of(path)
    fixed = header.get("block_size") if header.get("token_text") is False else None
    if given is None:
        return int(fixed or default)
    if fixed is not None and given != fixed:
        raise ValueError(
            f"this trace's blocks are {fixed} tokens (its header: block hashes, no token text); "
            f"drop --block-size or give {fixed}"
        )
    return given
