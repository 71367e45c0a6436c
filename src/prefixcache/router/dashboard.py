"""The router's live dashboard: ``GET /dashboard`` (the page, from :mod:`prefixcache.webui`) and
``GET /router/dashboard`` (its data): one row per replica (health, in-flight, routed, the hit rate
of the usage the router parsed from its answers, the prefix chunks the cache-aware record places
on it), the routed hit rate over time, fail-overs and load fall-backs.

Authentication is the API's: the router holds no keys, so it asks a healthy replica whether the
caller's key is good (``GET /v1/models`` with the caller's ``Authorization`` / ``x-api-key``).
A replica's 401 is the caller's 401; a key a replica accepted is remembered (by its SHA-256) for
:data:`KEY_OK_S` seconds, so the page's polling costs the replicas one request per key per
half-minute, and the page keeps working for that long when every replica is down. With no replica
able to answer, an unverified key gets a 503. Replicas without keys accept every caller, and so
does this page.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache import webui
from prefixcache.router.policies import Router
from prefixcache.router.proxy import Proxy

PAGE_ASSETS = ("dashboard.css", "common.js", "router.js")
DATA_PATH = "/router/dashboard"
KEY_OK_S = 30.0
KEYS_REMEMBERED = 1024
DEFAULT_INTERVAL_S = 2.0
DEFAULT_POINTS = 300


class KeyCheck:
    """Asks a replica whether a credential is good; remembers the good ones for a while."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._good: dict[str, float] = {}  # sha256(credential) -> when it was accepted

    async def check(self, proxy: Proxy, request: Request) -> Response | None:
        """None when the caller may read the dashboard, else the error response to send."""
        headers = {k: v for k in ("authorization", "x-api-key") if (v := request.headers.get(k)) is not None}
        digest = hashlib.sha256(repr(sorted(headers.items())).encode()).hexdigest()
        now = self.clock()
        seen = self._good.get(digest)
        if seen is not None and now - seen <= KEY_OK_S:
            return None
        for replica in [r for r in proxy.router.replicas if r.healthy]:
            reply = await proxy.send_one("GET", replica, "/v1/models", b"", headers)
            if reply.status == 200:
                if len(self._good) >= KEYS_REMEMBERED:
                    self._good.clear()
                self._good[digest] = now
                return None
            if reply.status == 401:
                return JSONResponse(reply.body, status_code=401, headers=webui.json_headers())
        message = "No healthy replica could check the API key; retry when one is up (see GET /health)."
        body = {"error": {"message": message, "type": "server_error", "code": "no_replica"}}
        return JSONResponse(body, status_code=503, headers={**webui.json_headers(), "retry-after": "2"})


class RouterSeries:
    """A ring buffer of the router's traffic, one point per interval: the routed hit rate of the
    interval (cached / prompt tokens the replicas reported), requests routed, in flight, healthy."""

    def __init__(
        self,
        router: Router,
        interval_s: float = DEFAULT_INTERVAL_S,
        points: int = DEFAULT_POINTS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.router = router
        self.interval_s = interval_s
        self.clock = clock
        self.points: deque[dict[str, Any]] = deque(maxlen=points)
        self._last = (0, 0, 0)  # prompt tokens, cached tokens, routed: at the last sample

    def sample(self) -> dict[str, Any]:
        snap = self.router.snapshot()
        prompt = sum(int(r["prompt_tokens"]) for r in snap)  # type: ignore[call-overload]
        cached = sum(int(r["cached_tokens"]) for r in snap)  # type: ignore[call-overload]
        routed = sum(int(r["routed"]) for r in snap)  # type: ignore[call-overload]
        d_prompt, d_cached = prompt - self._last[0], cached - self._last[1]
        point = {
            "t": round(self.clock(), 3),
            "hit_rate": round(d_cached / d_prompt, 4) if d_prompt > 0 else None,
            "prompt_tokens": d_prompt,
            "cached_tokens": d_cached,
            "routed": routed - self._last[2],
            "in_flight": sum(int(r["in_flight"]) for r in snap),  # type: ignore[call-overload]
            "healthy": sum(1 for r in snap if r["healthy"]),
        }
        self._last = (prompt, cached, routed)
        self.points.append(point)
        return point

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()  # O(replicas) under the router's lock: cheap enough for the loop


def dashboard_data(router: Router, series: RouterSeries) -> dict[str, Any]:
    """Everything ``GET /router/dashboard`` answers."""
    snap = router.snapshot()
    held = router.prefixes_by_replica()
    replicas = [{**r, "prefixes": held.get(str(r["url"]), 0)} for r in snap]
    prompt = sum(int(r["prompt_tokens"]) for r in snap)  # type: ignore[call-overload]
    cached = sum(int(r["cached_tokens"]) for r in snap)  # type: ignore[call-overload]
    return {
        "kind": "router",
        "policy": router.policy.value,
        "now": round(time.time(), 3),
        "interval_s": series.interval_s,
        "totals": {
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "routed": sum(int(r["routed"]) for r in snap),  # type: ignore[call-overload]
            "in_flight": sum(int(r["in_flight"]) for r in snap),  # type: ignore[call-overload]
            "healthy": sum(1 for r in snap if r["healthy"]),
            "replicas": len(snap),
            "failovers": router.failovers,
            "load_fallbacks": router.load_fallbacks,
            "record_entries": sum(held.values()),
        },
        "replicas": replicas,
        "series": list(series.points),
    }


def install(app: FastAPI, router: Router, proxy: Callable[[], Proxy], series: RouterSeries) -> None:
    """Add the dashboard's routes to ``app`` (before its catch-all proxy route). ``proxy``
    returns the app's :class:`Proxy` (made when the app starts)."""
    keys = KeyCheck()

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return webui.page("router")

    def asset_route(name: str) -> None:
        async def serve_asset() -> Response:
            return webui.asset(name)

        app.add_api_route(webui.ASSET_PREFIX + name, serve_asset, methods=["GET"], include_in_schema=False)

    for name in PAGE_ASSETS:
        asset_route(name)

    @app.get(DATA_PATH)
    async def data(request: Request) -> Response:
        refused = await keys.check(proxy(), request)
        if refused is not None:
            return refused
        return JSONResponse(dashboard_data(router, series), headers=webui.json_headers())
