"""API keys checked from the headers alone, before one byte of the body is read (server and router).

:class:`KeyGate` (ASGI middleware) answers every HTTP request whose path is not public with a
401 when ``check`` refuses its ``Authorization`` / ``x-api-key`` headers, so an unauthenticated
caller costs no body read, no JSON parse and no validation. Every path is gated unless it is
listed as public (liveness, metrics, the dashboard's page and the API's description): a route
added later is covered without any work of its own. The routes still resolve the tenant
themselves; the gate only makes sure that nothing is read for a caller without a valid key.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache.limits import Refuse, RejectedBody

#: Paths answered without a key: probes, Prometheus, the dashboard page (its data is gated) and
#: the API's own description. vLLM's ``/ping`` and ``/version`` probes are public there too, and so
#: are SGLang's engine descriptions that SMG reads before it has a key (they say what ``/health``
#: says: the model and the engine's limits, nothing of any tenant).
PUBLIC_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/version",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/metrics",
        "/dashboard",
        "/openapi.json",
        "/docs",
        "/redoc",
    }
)
#: Path prefixes answered without a key (the dashboard's static assets).
PUBLIC_PREFIXES = ("/dashboard/",)

MISSING_KEY = "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
INVALID_KEY = "Invalid API key: check the key you were given."


def presented_key(authorization: str | None, x_api_key: str | None) -> str:
    """The key a request presents (``x-api-key``, else a bearer ``Authorization``), or ``""``."""
    key = (x_api_key or "").strip()
    if not key and authorization:
        scheme, _, value = authorization.strip().partition(" ")
        key = value.strip() if scheme.lower() == "bearer" else ""
    return key


def find_key(keys: Iterable[str], key: str) -> str | None:
    """The entry of ``keys`` equal to ``key`` (None: none), compared in constant time per key so
    that timing says nothing about a key's prefix."""
    found = None
    for k in keys:
        if hmac.compare_digest(k.encode(), key.encode()):
            found = k
    return found


def key_check(keys: Collection[str]) -> Callable[[str | None, str | None], RejectedBody | None]:
    """A ``check`` for :class:`KeyGate` accepting the keys of ``keys``."""

    def check(authorization: str | None, x_api_key: str | None) -> RejectedBody | None:
        key = presented_key(authorization, x_api_key)
        if not key:
            return RejectedBody(401, MISSING_KEY, code="missing_api_key")
        if find_key(keys, key) is None:
            return RejectedBody(401, INVALID_KEY, code="invalid_api_key")
        return None

    return check


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


class KeyGate:
    """ASGI middleware: a 401 (rendered by ``refuse(path, rejection)``, the app's error shape)
    for a request to a non-public path whose headers ``check`` refuses; the body is never read
    and the connection is closed after the answer."""

    def __init__(
        self,
        app: ASGIApp,
        check: Callable[[str | None, str | None], RejectedBody | None],
        refuse: Refuse,
    ) -> None:
        self.app = app
        self.check = check
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_public(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        authorization = x_api_key = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":
                x_api_key = value.decode("latin-1")
        rejection = self.check(authorization, x_api_key)
        if rejection is None:
            await self.app(scope, receive, send)
            return
        response = self.refuse(scope.get("path", ""), rejection)
        response.headers["connection"] = "close"  # the unread body must not be parsed as a request
        await response(scope, receive, send)
