"""The server's request-body bounds, over the shared ones of :mod:`prefixcache.limits`.

* :class:`BodyLimit` (ASGI middleware): a body over ``max_bytes`` is a 413 in the route's error
  shape (OpenAI, or Anthropic under ``/v1/messages``), before the body is parsed.
* :class:`CheckedRoute` (the routers' route class): the JSON body is parsed by
  :func:`~prefixcache.limits.parse_json_body` (400 for lone surrogates and nesting deeper than
  :data:`~prefixcache.limits.MAX_JSON_DEPTH`). Bodies over :data:`OFF_LOOP_BYTES` are parsed in
  a worker thread, so a large body never stalls the event loop (``/health`` keeps answering).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from prefixcache import limits as shared
from prefixcache.limits import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    RejectedBody,
    json_depth,
    lone_surrogate_path,
    parse_json_body,
    too_large_message,
)
from prefixcache.server.errors import APIError, anthropic_error_body, is_anthropic_path, openai_error_body

__all__ = [
    "BODY_BYTES_PER_CONTEXT_TOKEN",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "OFF_LOOP_BYTES",
    "BodyLimit",
    "CheckedRequest",
    "CheckedRoute",
    "default_max_body_bytes",
    "json_depth",
    "lone_surrogate_path",
    "parse_json_body",
    "refuse_body",
    "too_large_message",
]

#: Body bytes allowed per context token: room for JSON escapes (``\\u00e9`` is 6 bytes for one
#: character) and several-character tokens, far above any prompt that fits the context.
BODY_BYTES_PER_CONTEXT_TOKEN = 32
OFF_LOOP_BYTES = 256 << 10


def default_max_body_bytes(context_len: int | None) -> int:
    """8 MiB, or 32 bytes per context token for models whose context needs more."""
    return max(DEFAULT_MAX_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * int(context_len or 0))


def refuse_body(path: str, rejection: RejectedBody) -> JSONResponse:
    """The response for a body (or a request) refused before routing, in ``path``'s API shape."""
    err = APIError(rejection.status_code, str(rejection.detail), param=rejection.param, code=rejection.code)
    body = anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)
    return JSONResponse(body, status_code=err.anthropic_status if is_anthropic_path(path) else err.status)


class BodyLimit(shared.BodyLimit):
    """:class:`prefixcache.limits.BodyLimit` answering in the server's error shapes."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app, max_bytes, refuse_body)


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
