"""Bounds on a request body, shared by the server and the router (no torch, no engine).

* :class:`BodyLimit` (ASGI middleware): a body over ``max_bytes`` is a 413, rendered by the
  app's own ``refuse`` callable (its API shapes). A ``Content-Length`` over the limit is
  answered before one byte of the body is read; a body without one (chunked) is counted as it
  streams in and refused (a :class:`RejectedBody` raised from ``receive``) once the count passes.
* :func:`parse_json_body`: ``json.loads`` that refuses (a 400 :class:`RejectedBody`, naming the
  field where it can) strings holding a lone UTF-16 surrogate (``"\\ud800"``: no tokenizer can
  encode it, and ``str.encode`` raises on it) and nesting deeper than :data:`MAX_JSON_DEPTH`
  (no schema here needs it; templates, encoders and ``json.loads`` itself recurse per level).

The server wraps these in ``prefixcache.server.limits`` (its error shapes, a checked route
class); the router applies them before it keys or forwards a request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The default body limit (the server's floor; the router's default).
DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64
#: Arrays and objects a body may hold (messages, content parts, tool schemas): each costs a
#: Python object and a validation step, so 8 MiB of ``{},`` must not reach either.
MAX_JSON_CONTAINERS = 20_000
#: JSON values a body may hold (so every list's length too): room for a 256k-token prompt.
MAX_JSON_ITEMS = 1 << 18

#: Raw JSON that may hold a surrogate: a ``\\uD800``-``\\uDFFF`` escape, or UTF-8 bytes of one
#: (``json.loads`` decodes bytes with ``surrogatepass``). A cheap filter: a hit is confirmed on
#: the parsed value, since a valid pair (an emoji) or an escaped backslash matches too.
_RAW_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: Bytes :func:`json_shape` scans at once (its numpy temporaries are about 50 bytes per byte).
_SCAN_SLICE = 1 << 20


class RejectedBody(StarletteHTTPException):
    """A body refused while it is read or parsed (over the size limit, lone surrogates, too deep).
    An HTTPException because FastAPI lets only those through from its body reading (any other
    error there becomes a bare 400); each app answers it in its own error shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(status, detail=message)
        self.param = param
        self.code = code


def too_large_message(size: int | None, limit: int) -> str:
    what = f"The request body is {size} bytes" if size is not None else "The request body is"
    return (
        f"{what} over this server's limit of {limit} bytes (--max-body-bytes): send a shorter "
        "prompt, it could not fit the model's context anyway."
    )


#: ``refuse(path, rejection)`` -> the response for a refused body, in the shape of ``path``'s API.
Refuse = Callable[[str, RejectedBody], Response]


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int, refuse: Refuse) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1; got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            rejection = RejectedBody(
                413, too_large_message(declared, self.max_bytes), code="request_too_large"
            )
            response = self.refuse(scope.get("path", ""), rejection)
            # The body is never read: close the connection rather than parse it as a next request.
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RejectedBody(413, too_large_message(None, self.max_bytes), code="request_too_large")
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length itself
    return None


@dataclass(frozen=True, slots=True)
class JsonShape:
    """What :func:`json_shape` counts in a JSON text (brackets and commas inside strings ignored)."""

    depth: int  # how deep arrays and objects nest
    containers: int  # arrays and objects
    commas: int  # separators: every list item and object member past the first of each


def json_shape(body: bytes) -> JsonShape:
    """The nesting depth, container and separator counts of the JSON text ``body``, in one
    linear pass of numpy operations over 1 MiB slices (no regex, no backtracking: any input,
    unterminated strings and escape runs included, costs the same per byte).

    A byte is escaped when an odd run of backslashes precedes it; an unescaped ``"`` toggles
    "inside a string"; brackets and commas count only outside strings. Exact for valid JSON;
    for invalid JSON the counts are some bound that ``json.loads`` then refuses anyway."""
    depth = max_depth = containers = commas = 0
    run = 0  # backslashes ending the previous slice
    inside = 0  # 1 while the previous slice ended inside a string
    view = memoryview(body)
    for start in range(0, len(body), _SCAN_SLICE):
        b = np.frombuffer(view[start : start + _SCAN_SLICE], dtype=np.uint8)
        n = len(b)
        idx = np.arange(n, dtype=np.int64)
        backslash = b == 92
        # Index of the last byte <= i that is not a backslash (-1: none in this slice).
        last_plain = np.maximum.accumulate(np.where(backslash, -1, idx))
        run_at = idx - last_plain  # backslashes ending at i
        run_at[last_plain < 0] += run  # a run that began in an earlier slice
        before = np.empty(n, dtype=np.int64)  # backslashes right before i
        before[0] = run
        before[1:] = run_at[:-1]
        quotes = (b == 34) & (before % 2 == 0)
        parity = (np.cumsum(quotes, dtype=np.int64) + inside) % 2
        outside = (parity == 0) & ~quotes
        opens = outside & ((b == 91) | (b == 123))
        closes = outside & ((b == 93) | (b == 125))
        level = np.cumsum(opens.astype(np.int64) - closes.astype(np.int64)) + depth
        max_depth = max(max_depth, int(level.max(initial=depth)))
        depth = int(level[-1])
        containers += int(np.count_nonzero(opens))
        commas += int(np.count_nonzero(outside & (b == 44)))
        run, inside = int(run_at[-1]), int(parity[-1])
    return JsonShape(max_depth, containers, commas)


def json_depth(body: bytes) -> int:
    """How deep the JSON text ``body`` nests arrays and objects (see :func:`json_shape`)."""
    return json_shape(body).depth


def lone_surrogate_path(value: Any) -> str | None:
    """Where the first string (or key) holding a lone surrogate is, as ``messages[0].content``
    (``""`` for the body itself), or None. Iterative: any depth, no recursion."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return _path_text(path)
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return _path_text(path)
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend(
                (child, (*path, i)) for i, child in enumerate(item) if isinstance(child, str | list | dict)
            )
    return None


def _path_text(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_json_body(body: bytes, *, max_items: int | None = None) -> Any:
    """``json.loads(body)``, refusing what no route can use (a :class:`RejectedBody` 400):
    nesting deeper than :data:`MAX_JSON_DEPTH`, more than :data:`MAX_JSON_CONTAINERS` arrays and
    objects or more than ``max_items`` values (default :data:`MAX_JSON_ITEMS`; a list's length
    is bounded by it) and strings with lone surrogates. The structure is counted by one linear
    scan before anything is parsed or validated. Malformed JSON raises ``json.JSONDecodeError``
    (or ``UnicodeDecodeError``) as ``json.loads`` does."""
    limit = MAX_JSON_ITEMS if max_items is None else max_items
    shape = json_shape(body)
    if shape.depth > MAX_JSON_DEPTH:
        raise RejectedBody(
            400,
            f"The request body nests JSON {shape.depth} levels deep; at most {MAX_JSON_DEPTH} "
            "are allowed: flatten it (tool schemas included).",
            code="too_deep",
        )
    if shape.containers > MAX_JSON_CONTAINERS:
        raise RejectedBody(
            400,
            f"The request body holds {shape.containers} JSON arrays and objects; at most "
            f"{MAX_JSON_CONTAINERS} are allowed: send fewer messages or content parts.",
            code="too_many_items",
        )
    if shape.commas + 1 > limit:
        raise RejectedBody(
            400,
            f"The request body holds over {limit} JSON values (lists included); send fewer "
            "(a prompt longer than the context could not run anyway).",
            code="too_many_items",
        )
    try:
        value = json.loads(body)
    except RecursionError as e:  # unreachable after the depth check; kept for safety
        raise RejectedBody(400, "The request body nests JSON too deeply.", code="too_deep") from e
    if _RAW_SURROGATE.search(body):
        where = lone_surrogate_path(value)
        if where is not None:
            field = f"'{where[:200]}'" if where else "The request body"
            raise RejectedBody(
                400,
                f"{field} is not valid text: it holds a lone UTF-16 surrogate (such as \\ud800 without "
                "its pair); send valid Unicode.",
                param=where[:200] or None,
                code="invalid_unicode",
            )
    return value
