"""The live dashboard: ``GET /dashboard`` (the page and its assets, no key needed) and
``GET /v1/dashboard`` (its data, with the API's own authentication).

The data is server-wide (the numbers ``/metrics`` publishes: traffic, TTFT, cache size, tiers,
queue) except the top prefixes and ``tenant_cache``, which are the caller's tenant's; an admin
tenant (``--admin-tenant``) sees every tenant's prefixes. Read off the event loop, as ``GET
/v1/cache``: a stale answer carries ``x-prefixcache-snapshot-age``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from prefixcache import webui
from prefixcache.cache.tiers import tier_stats
from prefixcache.server.auth import Tenant
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.ops.routes import STALE_HEADER, TENANT_FIELDS, cache_busy
from prefixcache.server.state import ServerState, get_state, get_tenant

router = APIRouter(route_class=CheckedRoute)
PAGE_ASSETS = ("dashboard.css", "common.js", "server.js")


# ---------------------------------------------------------------------- panels fed from elsewhere
def miss_reasons(state: ServerState, tenant: Tenant) -> dict[str, int]:
    """Prompt tokens the cache did not serve, by why the read ended (reason -> tokens): the
    server-wide ``prefixcache_cache_missed_tokens_total`` (as ``/metrics`` publishes it)."""
    return state.metrics.missed_tokens()


def _viewer(state: ServerState, tenant: Tenant) -> str | None:
    return state.caller_text.previews_for(tenant) if state.caller_text is not None else None


def busting_findings(state: ServerState, tenant: Tenant) -> list[dict[str, Any]]:
    """The caller's tenant's cache-busting findings from the live watch (``GET /v1/cache/report``;
    an admin's: every tenant's), one row per finding with its tenant and endpoint; empty when the
    watch is off."""
    if state.busting is None:
        return []
    keys = state.auth.api_keys
    names = sorted(set(keys.values())) if tenant.admin and keys else [tenant.name]
    rows = []
    for name in names:
        report = state.busting.live.report(name)
        if state.caller_text is not None:
            report = state.caller_text.busting_report(tenant, report)
        for e in report["endpoints"]:
            rows += [{"tenant": name, "endpoint": e["endpoint"], **row} for row in e["busting"]]
    return rows


# ---------------------------------------------------------------------- the data
def _tiers(cache: Any) -> list[dict[str, Any]]:
    rows = []
    for s in tier_stats(cache):
        row = s.as_dict()
        looked = s.hits + s.misses
        row["hit_rate"] = round(s.hits / looked, 4) if looked else None
        rows.append(row)
    return rows


def dashboard_data(state: ServerState, tenant: Tenant) -> dict[str, Any]:
    """Everything ``GET /v1/dashboard`` answers (blocking: takes the cache's lock)."""
    data: dict[str, Any] = {
        "kind": "server",
        "model": state.model_name,
        "tenant": tenant.name,
        "admin": tenant.admin,
        **state.dashboard.view(None if tenant.admin else tenant.name, _viewer(state, tenant)),
    }
    cache = state.bridge.cache
    if cache is not None:
        stats = cache.stats()
        mine = cache.stats(tenant.name).as_dict()
        data["cache"] = {
            "enabled": True,
            "blocks": stats.blocks,
            "bytes": stats.bytes,
            "capacity_bytes": stats.capacity_bytes,
            "pinned_blocks": stats.pinned_blocks,
            "evictions": {
                r: stats.evictions.get(r, 0)
                for r in sorted({"capacity", "ttl", "flush"} | set(stats.evictions))
            },
            "hit_rate": round(stats.hit_rate, 4),
        }
        data["tenant_cache"] = {k: mine[k] for k in TENANT_FIELDS if k in mine}
        data["tiers"] = _tiers(cache)
    else:
        data["cache"] = {"enabled": False}
        data["tenant_cache"] = None
        data["tiers"] = []
    auditor = getattr(state.engine, "auditor", None)
    data["verify"] = (
        None
        if auditor is None
        else {"verified": auditor.counts(), "degraded": auditor.degraded, "rate": auditor.rate}
    )
    data["miss_reasons"] = miss_reasons(state, tenant)
    data["busting"] = busting_findings(state, tenant)
    return data


# ---------------------------------------------------------------------- routes
@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    return webui.page("server")


def _asset_route(name: str) -> None:
    async def serve_asset() -> Response:
        return webui.asset(name)

    router.add_api_route(webui.ASSET_PREFIX + name, serve_asset, methods=["GET"], include_in_schema=False)


for _name in PAGE_ASSETS:
    _asset_route(_name)


@router.get("/v1/dashboard", summary="The live dashboard's data (top prefixes: the caller's tenant's)")
async def dashboard_json(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    state = get_state(request)
    snapshot = await state.snapshots.read(
        ("dashboard", tenant.name, tenant.admin), lambda: dashboard_data(state, tenant)
    )
    if snapshot is None:
        raise cache_busy()
    headers = webui.json_headers()
    if snapshot.stale:
        headers[STALE_HEADER] = f"{snapshot.age_s:.3f}"
    return JSONResponse(snapshot.value, headers=headers)
