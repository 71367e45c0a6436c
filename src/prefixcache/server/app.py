"""``create_app(engine)``: the FastAPI app in front of one :class:`~prefixcache.engine.Engine`.

Routes (OpenAI shape unless noted):

    POST   /v1/chat/completions        chat; SSE with "stream": true
    POST   /v1/completions             text completion; SSE with "stream": true
    POST   /v1/responses               OpenAI Responses; SSE with "stream": true
    POST   /v1/messages                Anthropic Messages; SSE with "stream": true
    POST   /v1/messages/count_tokens   Anthropic token count
    GET    /v1/models                  the served model
    GET    /v1/cache                   the caller's cache stats;  DELETE: flush the caller's blocks
    GET    /v1/cache/report            the caller's cache busting, found live
    POST   /v1/cache/pin               prefill + pin a prefix;    DELETE: unpin it
    GET    /v1/cache/verify            the exactness audit;       POST: check one prompt now
    POST   /v1/cache/verify/ack        acknowledge the audit's differences (admin)
    GET    /v1/dashboard               the live dashboard's data; GET /dashboard: its page
    GET    /metrics                    Prometheus text (prefixcache_ and vLLM's vllm: names)
    GET    /health                     liveness
    POST   /tokenize, /detokenize      vLLM's token routes
    POST   /v1/{chat/completions,completions,messages,responses}/render   vLLM's render routes
    GET    /version, /server_info, /model_info, /v1/loads   what routers probe (vLLM, SGLang shapes)
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixcache import __version__
from prefixcache.engine.config import DEFAULT_MAX_QUEUE  # one home: the engine's queue is the app's
from prefixcache.keygate import KeyGate, key_check
from prefixcache.server.anthropic import routes as routes_anthropic
from prefixcache.server.auth import Authenticator
from prefixcache.server.bridge import Admission, EngineBridge
from prefixcache.server.caller_text import CallerText, TextPolicy
from prefixcache.server.compat import engine_info as routes_engine_info
from prefixcache.server.compat import vllm as routes_vllm
from prefixcache.server.compat.engine_load import LoadSnapshot, VllmGauges, load_snapshot
from prefixcache.server.errors import install_error_handlers
from prefixcache.server.limits import BodyLimit, default_max_body_bytes, refuse_body
from prefixcache.server.openai import responses as routes_responses
from prefixcache.server.openai import routes as routes_openai
from prefixcache.server.ops import routes as routes_ops
from prefixcache.server.ops import routes_dashboard
from prefixcache.server.ops import verify as routes_verify
from prefixcache.server.ops.busting import DEFAULT_WINDOW, BustingWatch, LiveBusting
from prefixcache.server.ops.dashboard import DEFAULT_INTERVAL_S, DashboardRecorder, DashboardSources
from prefixcache.server.ops.metrics import Metrics
from prefixcache.server.ops.snapshots import SnapshotReader
from prefixcache.server.ops.tracelog import TraceLog, engine_header
from prefixcache.server.state import ServerState

log = logging.getLogger(__name__)

DEFAULT_TENANT_QUEUE_SHARE = 0.5
DEFAULT_TENANT_PIN_SHARE = 0.5
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
#: Worker threads beyond ``max_queue`` (body parsing, cache snapshots, pins, flushes).
THREAD_HEADROOM = 16


class RequestCounter:
    """ASGI middleware: ``prefixcache_requests_total{route,status}`` per HTTP request. ``route``
    is the route's path (``other`` for no route, so fuzzing cannot blow up the label set)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            route = path if path in self.paths else "other"
            self.metrics.count_request(route, status)


def create_app(
    engine: Any,
    *,
    api_keys: Mapping[str, str] | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    trace_log: str | Path | None = None,
    trace_text: bool = False,
    trace_keys_only: bool = False,
    model_name: str = DEFAULT_MODEL_NAME,
    salt_secret: str | bytes | None = None,
    trace_tokenizer: str | None = None,
    max_body_bytes: int | None = None,
    tenant_queue_share: float = DEFAULT_TENANT_QUEUE_SHARE,
    admin_tenants: Iterable[str] = (),
    dashboard_interval_s: float = DEFAULT_INTERVAL_S,
    tenant_pin_share: float = DEFAULT_TENANT_PIN_SHARE,
    tenant_capacity_share: float | None = None,
    busting_window: int = DEFAULT_WINDOW,
    caller_text: TextPolicy | str | None = None,
) -> FastAPI:
    """Build the app. ``api_keys``: key -> tenant (None: one ``default`` tenant, no auth).
    ``max_queue``: generation requests in flight (running or waiting) before 429/529.
    ``trace_log``: a JSONL trace (file 0600); ``trace_text`` adds the prompt text,
    ``trace_keys_only`` writes salted block keys instead of token ids (privacy mode).
    ``salt_secret``: the tenant-salt secret (default ``$PREFIXCACHE_SALT_SECRET`` or random).
    ``max_body_bytes``: a larger body is a 413 before it is parsed (default: 8 MiB, or 32 bytes
    per context token for a longer context). ``tenant_queue_share``: with two tenants or more,
    the share of ``max_queue`` one tenant may hold (at least one request); ``tenant_pin_share``
    likewise of the cache's pinned budget (``POST /v1/cache/pin`` answers 409 beyond);
    ``tenant_capacity_share`` of its capacity, past which a tenant evicts its own blocks first
    (None: one LRU; see :mod:`~prefixcache.cache.shares`).
    ``busting_window``: requests per endpoint the live cache-busting watch compares (0: no
    watch; see :mod:`~prefixcache.server.ops.busting`). ``admin_tenants``: tenants of ``api_keys``
    that see every tenant's prefixes on the dashboard. ``dashboard_interval_s``: seconds between
    two points of the dashboard's time series. ``caller_text``: whose prompt text miss reasons,
    the dashboard and the busting report show (:mod:`~prefixcache.server.caller_text`; default
    ``own`` with API keys, ``all`` without; ``serve`` passes ``none`` for a non-loopback address
    without keys)."""
    tenants = len(set(api_keys.values())) if api_keys else 1
    tenant_limit = Admission.tenant_limit_for(max_queue, tenant_queue_share, tenants)
    bridge = EngineBridge(engine, max_queue, tenant_limit)
    if bridge.cache is not None and tenants > 1:
        bridge.cache.limit_tenant_pins(tenant_pin_share)
        if tenant_capacity_share is not None:
            bridge.cache.limit_tenant_capacity(tenant_capacity_share)
    metrics = Metrics(
        stats_fn=lambda: bridge.cache.stats() if bridge.cache is not None else None,
        queue_depth_fn=lambda: bridge.admission.depth,
        prefilled_fn=lambda: int(getattr(engine, "prefilled_tokens", 0)),
    )
    trace = None
    if trace_log:
        trace = TraceLog(
            trace_log,
            include_text=trace_text,
            tokenizer=trace_tokenizer,
            keys_only=trace_keys_only,
            block_size=bridge.block_size,
            header=engine_header(engine),
        )

    auth = Authenticator(api_keys, salt_secret, admin_tenants)
    dashboard = DashboardRecorder(_dashboard_sources(bridge, engine), interval_s=dashboard_interval_s)

    snapshots = SnapshotReader()
    busting = None
    if busting_window:
        busting = BustingWatch(
            LiveBusting(lambda: engine.tokenizer, window=busting_window, log_examples=not trace_keys_only)
        )
        metrics.registry.register(busting.collector())
    metrics.registry.register(_vllm_gauges(bridge, metrics, model_name))
    if getattr(engine, "auditor", None) is not None:
        metrics.registry.register(routes_verify.VerifyCollector(engine.auditor))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Every admitted generation holds a worker thread while it runs or waits: a pool smaller
        # than the queue (anyio's default is 40) would let one tenant's waiting requests hold
        # every thread that body parsing, cache reads and the other tenants need.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, max_queue + THREAD_HEADROOM)
        dashboard.start()
        try:
            yield
        finally:
            dashboard.close()
            snapshots.close()
            if busting is not None:
                busting.close()
            if trace is not None:
                trace.close()

    app = FastAPI(
        lifespan=lifespan,
        title="prefixcache",
        version=__version__,
        summary="OpenAI- and Anthropic-compatible inference with exact prefix caching.",
    )
    app.state.prefixcache = ServerState(
        engine=engine,
        bridge=bridge,
        auth=auth,
        metrics=metrics,
        trace=trace,
        model_name=model_name,
        snapshots=snapshots,
        dashboard=dashboard,
        busting=busting,
        caller_text=CallerText(
            TextPolicy(caller_text) if caller_text else TextPolicy.default(api_keys is not None),
            lambda tenant, ids: bridge.enabled_cache.block_keys(
                ids, bridge.namespace(tenant.name, tenant.salt)
            ),
            bridge.block_size,
            _shared_tenants(api_keys),
        ),
    )
    install_error_handlers(app)
    routers = (
        routes_openai,
        routes_responses,
        routes_anthropic,
        routes_ops,
        routes_verify,
        routes_dashboard,
        routes_vllm,
        routes_engine_info,
    )
    for module in routers:
        app.include_router(module.router)
    # No route has path parameters, so the path is the route template.
    paths = frozenset(str(getattr(r, "path", "")) for m in routers for r in m.router.routes)
    body_limit = max_body_bytes or default_max_body_bytes(getattr(engine, "context_len", None))
    app.add_middleware(BodyLimit, max_bytes=body_limit)
    if auth.api_keys is not None:  # the key checked before the body is read (any route, new ones too)
        app.add_middleware(KeyGate, check=key_check(auth.api_keys), refuse=refuse_body)
    app.add_middleware(RequestCounter, metrics=metrics, paths=paths)  # outermost: counts the 413s too
    return app


def _shared_tenants(api_keys: Mapping[str, str] | None) -> frozenset[str]:
    """The tenants of several keys (their callers share a namespace)."""
    counts = collections.Counter((api_keys or {}).values())
    return frozenset(t for t, n in counts.items() if n > 1)


def _vllm_gauges(bridge: EngineBridge, metrics: Metrics, model_name: str) -> VllmGauges:
    def stats() -> Any:
        return bridge.cache.stats() if bridge.cache is not None else None

    def load() -> LoadSnapshot:
        return load_snapshot(bridge.admission.depth, bridge.max_n, stats())

    def tokens() -> tuple[float, float]:
        return metrics.total(metrics.prompt_tokens), metrics.total(metrics.completion_tokens)

    return VllmGauges(model_name, load, stats, tokens)


def _dashboard_sources(bridge: EngineBridge, engine: Any) -> DashboardSources:
    def keys(tenant: str, salt: bytes, ids: list[int]) -> list[bytes]:
        cache = bridge.cache
        return list(cache.block_keys(ids, bridge.namespace(tenant, salt))) if cache is not None else []

    return DashboardSources(
        keys=keys,
        decode=bridge.decode,
        prefilled=lambda: int(getattr(engine, "prefilled_tokens", 0)),
        queue_depth=lambda: bridge.admission.depth,
    )
