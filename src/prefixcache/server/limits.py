"""Bounds on a request body, checked before any route looks at it.

* :class:`BodyLimit` (ASGI middleware): a body over ``max_bytes`` is a 413 in the route's error
  shape. A ``Content-Length`` over the limit is answered before one byte of the body is read; a
  body without one (chunked) is counted as it streams in and refused once the count passes.
* :class:`CheckedRoute` (the routers' route class): the JSON body is parsed by
  :func:`parse_json_body`, which refuses (400, naming the field where it can) strings holding a
  lone UTF-16 surrogate (``"\\ud800"``: no tokenizer can encode it) and nesting deeper than
  :data:`MAX_JSON_DEPTH` (no schema here needs it; templates and encoders recurse per level).
  Bodies over :data:`OFF_LOOP_BYTES` are parsed in a worker thread, so a large body never
  stalls the event loop (``/health`` keeps answering).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import numpy as np
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixcache.server.errors import (
    APIError,
    RejectedBody,
    anthropic_error_body,
    is_anthropic_path,
    openai_error_body,
)

#: The default body limit, and the floor of :func:`default_max_body_bytes`.
DEFAULT_MAX_BODY_BYTES = 8 << 20
#: Body bytes allowed per context token: room for JSON escapes (``\\u00e9`` is 6 bytes for one
#: character) and several-character tokens, far above any prompt that fits the context.
BODY_BYTES_PER_CONTEXT_TOKEN = 32
MAX_JSON_DEPTH = 64
OFF_LOOP_BYTES = 256 << 10

#: Raw JSON that may hold a surrogate: a ``\\uD800``-``\\uDFFF`` escape, or UTF-8 bytes of one
#: (``json.loads`` decodes bytes with ``surrogatepass``). A cheap filter: a hit is confirmed on
#: the parsed value, since a valid pair (an emoji) or an escaped backslash matches too.
_RAW_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: A JSON string literal, so that brackets inside strings do not count as nesting.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)


def default_max_body_bytes(context_len: int | None) -> int:
    """8 MiB, or 32 bytes per context token for models whose context needs more."""
    return max(DEFAULT_MAX_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * int(context_len or 0))


def too_large_message(size: int | None, limit: int) -> str:
    what = f"The request body is {size} bytes" if size is not None else "The request body is"
    return (
        f"{what} over this server's limit of {limit} bytes (--max-body-bytes): send a shorter "
        "prompt, it could not fit the model's context anyway."
    )


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1; got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            err = APIError(413, too_large_message(declared, self.max_bytes), code="request_too_large")
            path = scope.get("path", "")
            body = anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)
            # The body is never read: close the connection rather than parse it as a next request.
            await JSONResponse(body, status_code=413, headers={"connection": "close"})(scope, receive, send)
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


def json_depth(body: bytes) -> int:
    """How deep the JSON text ``body`` nests arrays and objects (brackets in strings ignored).
    Linear and vectorised: the strings are blanked by one regex, the brackets summed by numpy."""
    structure = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    opens = (structure == ord("[")) | (structure == ord("{"))
    closes = (structure == ord("]")) | (structure == ord("}"))
    steps = opens.astype(np.int64) - closes.astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


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


def parse_json_body(body: bytes) -> Any:
    """``json.loads(body)``, refusing what no route can use (a :class:`RejectedBody` 400):
    nesting deeper than :data:`MAX_JSON_DEPTH` and strings with lone surrogates. Malformed JSON
    raises ``json.JSONDecodeError`` as ``json.loads`` does (FastAPI answers it)."""
    # Fewer brackets than the limit cannot nest deeper than it: most bodies skip the scan.
    depth = json_depth(body) if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:
        raise RejectedBody(
            400,
            f"The request body nests JSON {depth} levels deep; at most {MAX_JSON_DEPTH} "
            "are allowed: flatten it (tool schemas included).",
            code="too_deep",
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


class CheckedRequest(Request):
    """A request whose :meth:`json` is :func:`parse_json_body` (off the loop for large bodies)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await anyio.to_thread.run_sync(parse_json_body, body)
            else:
                self._json = parse_json_body(body)
        return self._json


class CheckedRoute(APIRoute):
    """The route class of every router here: handlers see a :class:`CheckedRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked
