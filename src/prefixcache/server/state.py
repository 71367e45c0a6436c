"""What every route shares: the engine bridge, the authenticator, metrics and the trace log."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from prefixcache.server.auth import Authenticator, Tenant
from prefixcache.server.bridge import EngineBridge
from prefixcache.server.caller_text import CallerText
from prefixcache.server.errors import APIError
from prefixcache.server.ops.busting import BustingWatch
from prefixcache.server.ops.dashboard import DashboardRecorder
from prefixcache.server.ops.diagnostics import DiagnosticsRecord
from prefixcache.server.ops.metrics import Metrics
from prefixcache.server.ops.snapshots import SnapshotReader
from prefixcache.server.ops.tracelog import TraceLog

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerState:
    engine: Any
    bridge: EngineBridge
    auth: Authenticator
    metrics: Metrics
    trace: TraceLog | None
    model_name: str
    snapshots: SnapshotReader  # cache reads off the event loop (/metrics, GET /v1/cache)
    dashboard: DashboardRecorder  # GET /v1/dashboard: series and top prefixes
    diagnostics: DiagnosticsRecord = field(default_factory=DiagnosticsRecord)  # Anthropic's, by answer id
    busting: BustingWatch | None = None  # live cache-busting detection (GET /v1/cache/report)
    caller_text: CallerText | None = None  # whose prompt text a caller may see (None: everyone's)

    def check_model(self, model: str) -> None:
        """404 in the route's shape unless ``model`` is the one this server serves."""
        if model != self.model_name:
            raise APIError(
                404,
                f"Unknown model '{model[:200]}': this server serves '{self.model_name}' "
                "(see GET /v1/models).",
                param="model",
                code="model_not_found",
            )


def get_state(request: Request) -> ServerState:
    return request.app.state.prefixcache


def get_tenant(request: Request) -> Tenant:
    """FastAPI dependency: the caller's tenant (401 in the route's shape without a valid key).

    The two headers are read from the request, not declared as ``Header`` parameters: FastAPI
    builds a pydantic adapter for each declared parameter on a route's first request and hides
    pydantic's warning about its ``alias`` with ``warnings.catch_warnings``, which is not
    thread-safe, so servers starting side by side printed "The 'alias' attribute with value
    'authorization' ... has no effect"."""
    headers = request.headers
    return get_state(request).auth.authenticate(headers.get("authorization"), headers.get("x-api-key"))
