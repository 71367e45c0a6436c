"""The router's HTTP side: an OpenAI and Anthropic pass-through proxy in front of replicas.

    POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens
         and any other path: proxied to the replica the policy picks (streaming relayed as is)
    POST /v1/cache/pin, DELETE /v1/cache/pin: sent to every healthy replica (keep-warm)
    GET  /health                 200 while at least one replica is healthy, else 503
    GET  /metrics                Prometheus: per-replica routing, in-flight, hit rate, fail-overs
    GET  /router/replicas        the same as JSON (and the KV event feeds' state, with --kv-events)
    GET  /dashboard              the live page; GET /router/dashboard: its data (the API's keys)

Every body is bounded first: over ``max_body_bytes`` is a 413 before it is read
(:class:`~prefixcache.limits.BodyLimit`), in the error shape of the API called. With
``api_keys`` (``route --api-keys``) every path but ``/health``, ``/metrics`` and the dashboard's
page needs one of them, checked from the headers before the body is read
(:class:`~prefixcache.keygate.KeyGate`); ``/router/replicas`` (which names the KV event
endpoints) is among the gated paths.

The app wires the parts together: a :class:`~prefixcache.router.policies.Router` (replica state
and policy), a :class:`~prefixcache.router.proxy.Proxy` (relaying, fail-over: its contract is in
:mod:`~prefixcache.router.proxy`), the health loop, and keep-warm
(:class:`~prefixcache.router.keepwarm.KeepWarm`, handed the proxy's send-to-every-healthy-replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixcache import __version__
from prefixcache.keygate import KeyGate, key_check
from prefixcache.limits import BodyLimit, RejectedBody
from prefixcache.router import dashboard
from prefixcache.router.config import RouterConfig
from prefixcache.router.keepwarm import KeepWarm
from prefixcache.router.kv_index import KVIndex
from prefixcache.router.policies import Policy, Router
from prefixcache.router.proxy import Proxy, error_response

log = logging.getLogger(__name__)


def render_metrics(router: Router) -> bytes:
    """Prometheus text for the router (per-replica labels)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> list[Any]:
            snap = router.snapshot()
            fams: list[Any] = []
            spec = [
                ("requests", "routed", "Requests sent to the replica (fail-over attempts included).", True),
                ("completed", "completed", "Requests the replica answered.", True),
                (
                    "failed",
                    "failed",
                    "Requests that failed at the replica after nothing could be retried.",
                    True,
                ),
                (
                    "connect_failures",
                    "connect_failures",
                    "Requests lost to a refused, reset or closed connection (replica marked down).",
                    True,
                ),
                (
                    "timeouts",
                    "timeouts",
                    "Requests the replica sent nothing for within the read timeout (not marked down).",
                    True,
                ),
                (
                    "broken_streams",
                    "broken_streams",
                    "Streams cut after bytes went to the client (ended with an error event, not retried).",
                    True,
                ),
                ("prompt_tokens", "prompt_tokens", "Prompt tokens the replica reported.", True),
                ("cached_tokens", "cached_tokens", "Prompt tokens the replica served from cache.", True),
                ("in_flight", "in_flight", "Requests in flight at the replica.", False),
                ("healthy", "healthy", "1 while the replica passes health checks.", False),
                ("hit_rate", "hit_rate", "cached_tokens / prompt_tokens at the replica.", False),
            ]
            for name, field, doc, counter in spec:
                metric = f"prefixcache_router_{name}"
                fam: Any = (
                    CounterMetricFamily(metric, doc, labels=["replica"])
                    if counter
                    else GaugeMetricFamily(metric, doc, labels=["replica"])
                )
                for r in snap:
                    fam.add_metric([str(r["url"])], float(r[field]))  # type: ignore[arg-type]
                fams.append(fam)
            total_p = sum(int(r["prompt_tokens"]) for r in snap)  # type: ignore[call-overload]
            total_c = sum(int(r["cached_tokens"]) for r in snap)  # type: ignore[call-overload]
            g = GaugeMetricFamily(
                "prefixcache_router_hit_rate_total", "cached / prompt tokens over all replicas."
            )
            g.add_metric([], total_c / total_p if total_p else 0.0)
            fams.append(g)
            fo = CounterMetricFamily(
                "prefixcache_router_failovers", "Requests retried on another replica (at most once each)."
            )
            fo.add_metric([], router.failovers)
            fams.append(fo)
            lf = CounterMetricFamily(
                "prefixcache_router_load_fallbacks", "Routing overridden by the load guard."
            )
            lf.add_metric([], router.load_fallbacks)
            fams.append(lf)
            rec = GaugeMetricFamily(
                "prefixcache_router_prefix_record_entries", "Chunk hashes in the prefix record."
            )
            rec.add_metric([], len(router.record))
            fams.append(rec)
            if router.kv_index is not None:
                fams.extend(kv_metrics(router.kv_index))
            return fams

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


def create_router_app(config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router app. ``transport`` lets tests route to in-process apps."""
    kv_index = _kv_index(config)
    router = Router(
        config.replicas,
        config.policy,
        load_factor=config.load_factor,
        load_slack=config.load_slack,
        record_ttl_s=config.record_ttl_s,
        kv_index=kv_index,
    )
    state: dict[str, Any] = {}
    series = dashboard.RouterSeries(router, config.dashboard_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
            proxy = Proxy(router, config, client)
            state["proxy"] = proxy
            if kv_index is not None:
                kv_index.start()
            tasks = [
                asyncio.create_task(_health_loop(proxy, config.health_interval_s)),
                asyncio.create_task(series.run()),
            ]
            keepwarm = KeepWarm.load(config.keepwarm_file) if config.keepwarm_file else None
            if keepwarm is not None:
                state["keepwarm"] = keepwarm
                tasks.append(asyncio.create_task(keepwarm.run(proxy.send_to_healthy)))
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
                if kv_index is not None:
                    kv_index.close()

    app = FastAPI(title="prefixcache router", version=__version__, lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, refuse=_refuse)
    if config.api_keys:  # the key checked before the body is read, on every non-public path
        app.add_middleware(KeyGate, check=key_check(config.api_keys), refuse=_refuse)

    @app.exception_handler(RejectedBody)
    async def rejected(request: Request, exc: RejectedBody) -> Response:  # a chunked body over the limit
        return _refuse(request.url.path, exc)

    @app.get("/health")
    async def health() -> Response:
        up = sum(1 for r in router.replicas if r.healthy)
        body = {"status": "ok" if up else "down", "healthy_replicas": up, "replicas": len(router.replicas)}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(router), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/replicas")
    async def replicas() -> Any:
        body = {"policy": router.policy.value, "replicas": router.snapshot(), "failovers": router.failovers}
        if kv_index is not None:
            body["kv_events"] = kv_index.snapshot()
            body["kv_anchors"] = len(kv_index.anchors)
        return body

    dashboard.install(app, router, lambda: state["proxy"], series)

    @app.api_route("/v1/cache/pin", methods=["POST", "DELETE"])
    async def pin(request: Request) -> Response:
        return await state["proxy"].broadcast(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxied(path: str, request: Request) -> Response:
        return await state["proxy"].handle(request)

    return app


def _refuse(path: str, rejection: RejectedBody) -> JSONResponse:
    return error_response(
        rejection.status_code, str(rejection.detail), path, rejection.code or "invalid_request"
    )


def _kv_index(config: RouterConfig) -> KVIndex | None:
    """The KV event index of a cache-aware router with ``kv_events``; ValueError naming a feed
    whose replica is not one of ``replicas``, or events under another policy."""
    if not config.kv_events:
        return None
    if Policy(config.policy) is not Policy.CACHE_AWARE:
        raise ValueError(f"--kv-events needs --policy cache-aware (not {Policy(config.policy).value})")
    urls = {u.rstrip("/") for u in config.replicas}
    feeds = {url.rstrip("/"): spec for url, spec in config.kv_events.items()}
    unknown = sorted(set(feeds) - urls)
    if unknown:
        raise ValueError(f"--kv-events names {unknown[0]}, which is not a --replica; give its exact URL")
    return KVIndex(feeds, config.chunk_chars, curve=config.kv_events_curve)


def kv_metrics(kv_index: KVIndex) -> list[Any]:
    """Prometheus families of the router's KV event feeds (per replica)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    snap = kv_index.snapshot()
    spec = [
        ("batches", "Event batches applied (live or replayed).", True),
        ("replayed", "Event batches applied from the replay socket.", True),
        ("gaps", "Jumps in the live sequence numbers.", True),
        ("lost", "Sequence ranges no replay could fill.", True),
        ("blocks", "Blocks the replica holds by its events.", False),
        ("synced", "1 while the router's view of the replica is complete.", False),
        ("undecodable", "Event messages that could not be decoded or applied (the feed went on).", True),
    ]
    fams: list[Any] = []
    for name, doc, counter in spec:
        metric = f"prefixcache_router_kv_events_{name}"
        fam: Any = (
            CounterMetricFamily(metric, doc, labels=["replica"])
            if counter
            else GaugeMetricFamily(metric, doc, labels=["replica"])
        )
        for url, row in snap.items():
            fam.add_metric([url], float(row[name]))
        fams.append(fam)
    anchors = GaugeMetricFamily(
        "prefixcache_router_kv_anchors", "Routing chunks tied to a block hash (learned from replicas)."
    )
    anchors.add_metric([], len(kv_index.anchors))
    fams.append(anchors)
    return fams


async def _health_loop(proxy: Proxy, interval_s: float) -> None:
    while True:
        try:
            await proxy.check_health()
        except Exception:  # the loop must outlive any single failure
            log.exception("router: health check round failed")
        await asyncio.sleep(interval_s)
