"""The live dashboard's page: HTML, CSS and plain JavaScript shipped in the package (no CDN, no
library), served by ``prefixcache serve`` and ``prefixcache route`` at ``GET /dashboard``.

The page loads without a key; it polls a JSON endpoint every two seconds with the key the user
typed into it, kept in the tab's ``sessionStorage`` (gone when the tab closes) and sent as
``Authorization: Bearer``. A key is never put in a URL query (proxies log queries, and browsers
send them on in ``Referer``); ``/dashboard#key=...`` is read once by the page, moved into
``sessionStorage`` and erased from the address bar (a fragment never leaves the browser).

Every response carries a Content-Security-Policy that allows scripts, styles and fetches from
the page's own origin only, and the page writes data with ``textContent`` only (a prefix preview
is prompt text: it must never become markup).

Both apps call :func:`page` and :func:`asset` (the router may not import the server: this
module imports neither).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.responses import Response

PAGES = ("server", "router")
#: The assets a page loads, served at ``/dashboard/<name>``, and their media types.
ASSETS = {
    "dashboard.css": "text/css; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "server.js": "text/javascript; charset=utf-8",
    "router.js": "text/javascript; charset=utf-8",
}
ASSET_PREFIX = "/dashboard/"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


@cache
def read_static(name: str) -> bytes:
    """The bytes of a packaged file under ``static/`` (``FileNotFoundError`` if it is not shipped)."""
    return resources.files(__name__).joinpath("static", name).read_bytes()


def page(kind: str) -> Response:
    """The dashboard page of ``kind`` (``server`` or ``router``)."""
    if kind not in PAGES:
        raise ValueError(f"no dashboard page {kind!r}; pages: {', '.join(PAGES)}")
    headers = {**SECURITY_HEADERS, "cache-control": "no-cache"}
    return Response(read_static(f"{kind}.html"), media_type="text/html; charset=utf-8", headers=headers)


def asset(name: str) -> Response:
    """One of :data:`ASSETS` (``KeyError`` for any other name: callers route only these)."""
    media_type = ASSETS[name]
    headers = {**SECURITY_HEADERS, "cache-control": "no-cache"}
    return Response(read_static(name), media_type=media_type, headers=headers)


def json_headers() -> dict[str, str]:
    """Headers of the dashboards' JSON: never cached (it is per key and changes every poll)."""
    return {"cache-control": "no-store", "x-content-type-options": "nosniff"}
