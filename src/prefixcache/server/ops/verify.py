"""The exactness audit's routes and metric (the audit itself: ``engine/serving/verify.py``).

    GET  /v1/cache/verify        the audit: rate, counts, degraded, the caller's differences
    POST /v1/cache/verify        check one prompt now (the caller's tenant): recompute and compare
    POST /v1/cache/verify/ack    an operator has seen the differences: /health is "ok" again

``prefixcache_cache_verified_total{result="equal|differ|skipped"}`` counts the checks. A
difference marks ``GET /health`` ``"degraded"`` (still 200: the blocks concerned are already
removed, so answers are exact again) until an admin acknowledges it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from prefixcache.server.auth import Tenant
from prefixcache.server.errors import APIError
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.ops.routes import PinRequest, prefix_ids
from prefixcache.server.state import get_state, get_tenant

router = APIRouter(route_class=CheckedRoute)

RESULTS = ("equal", "differ", "skipped")


class VerifyCollector(Collector):
    """``prefixcache_cache_verified_total`` read from the auditor at scrape time."""

    def __init__(self, auditor: Any) -> None:
        self.auditor = auditor

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "prefixcache_cache_verified",
            "Cache hits recomputed with the cache bypassed by the exactness audit, by result "
            "(equal: logits and KV bitwise the same; differ: not; skipped: a hit block left first).",
            labels=["result"],
        )
        counts = self.auditor.counts()
        for result in RESULTS:
            family.add_metric([result], counts.get(result, 0))
        yield family


def auditor_of(request: Request) -> Any:
    auditor = getattr(get_state(request).engine, "auditor", None)
    if auditor is None:
        raise APIError(
            400,
            "The exactness audit is not available on this server (it needs the own Llama runner "
            "with the cache on).",
            code="verify_unavailable",
        )
    return auditor


def audit_summary(engine: Any, tenant: str | None) -> dict[str, Any] | None:
    """The audit's state for GET /v1/cache and the dashboard (None: no audit)."""
    auditor = getattr(engine, "auditor", None)
    if auditor is None:
        return None
    view = auditor.as_dict(tenant)
    return {"rate": view["rate"], "verified": view["verified"], "degraded": view["degraded"]}


@router.get("/v1/cache/verify", summary="The exactness audit: counts, state, the caller's differences")
async def verify_state(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """Differences are the caller's tenant's (an admin sees every tenant's)."""
    auditor = auditor_of(request)
    return auditor.as_dict(None if tenant.admin else tenant.name)


@router.post("/v1/cache/verify", summary="Check one prompt now: recompute it and compare bit for bit")
async def verify_prompt(body: PinRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """The prompt (``messages``, ``prompt`` or ``prompt_token_ids``, as for ``/v1/cache/pin``;
    messages are rendered with the assistant turn, as a chat request prefills them) runs one
    greedy token in the caller's namespace; when it reads cached blocks, it is recomputed with
    the cache bypassed and its logits and KV are compared. ``result``: equal, differ,
    not_cached (no block of it is cached: nothing to compare) or skipped."""
    auditor_of(request)
    bridge = get_state(request).bridge
    if (
        body.messages is not None
        and body.tools is None
        and body.prompt is None
        and body.prompt_token_ids is None
    ):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await bridge.run(lambda: bridge.render_ids(messages))
    else:
        ids = await prefix_ids(request, body)
    engine = bridge.engine
    result = await bridge.run(
        lambda: engine.verify(prompt_token_ids=ids, tenant=tenant.name, salt=tenant.salt)
    )
    return result.as_dict()


@router.post("/v1/cache/verify/ack", summary="Acknowledge the audit's differences (admin)")
async def verify_ack(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """Clears the degraded state of ``/health``. An admin tenant only (``--admin-tenant``); a
    server without API keys has one operator, who may."""
    state = get_state(request)
    auditor = auditor_of(request)
    if state.auth.api_keys is not None and not tenant.admin:
        raise APIError(
            403,
            "Only an admin tenant (--admin-tenant) may acknowledge the exactness audit's differences.",
            code="admin_only",
        )
    return {"acknowledged": auditor.acknowledge(), "degraded": auditor.degraded}
