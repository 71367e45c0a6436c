"""What routers probe to learn which engine a replica runs and how loaded it is:
GET /version (vLLM), GET /server_info and /model_info (SGLang, and their older ``/get_`` names),
GET /v1/loads and /loads (SGLang's load shape; also ``/get_loads``).

SMG finds a replica's engine from ``/v1/models`` ``owned_by``, else from ``/version`` (vLLM) and
``/server_info`` (SGLang); a replica that answers ``/version`` is read as vLLM, and its load is
read from the ``vllm:`` gauges on ``/metrics`` (see :mod:`~prefixcache.server.compat.engine_load`).

``/version``, ``/server_info`` and ``/model_info`` say what ``/health`` says (the model, its
context, this server's version and batch size): no key needed. The loads are ``/v1`` routes and
need a key like the others, and hold server-wide totals only.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

import prefixcache
from prefixcache.server.auth import Tenant
from prefixcache.server.compat.engine_load import LoadSnapshot, load_snapshot, sglang_loads
from prefixcache.server.errors import bad_request
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.ops.routes import cache_busy
from prefixcache.server.state import ServerState, get_state, get_tenant

router = APIRouter(route_class=CheckedRoute)

#: SMG asks for these sections of /v1/loads; this server has ``core`` (and nothing to say in the others).
LOAD_SECTIONS = frozenset({"core", "disagg", "queues", "memory"})


def current_load(state: ServerState) -> LoadSnapshot:
    """The server's load now (reads the cache's stats: call off the loop, or from a scrape)."""
    cache = state.bridge.cache
    stats = cache.stats() if cache is not None else None
    return load_snapshot(state.bridge.admission.depth, state.bridge.max_n, stats)


def context_len(state: ServerState) -> int:
    return int(getattr(state.engine, "context_len", 0) or 0)


@router.get("/version", summary="This server's version (vLLM shape)")
async def version() -> Any:
    return {"version": prefixcache.__version__}


def _server_info(state: ServerState) -> dict[str, Any]:
    """SGLang's ``/server_info`` fields that routers read (a subset: SGLang has hundreds)."""
    return {
        "model_path": state.model_name,
        "served_model_name": state.model_name,
        "tokenizer_path": state.model_name,
        "context_length": context_len(state),
        "max_running_requests": state.bridge.max_n,
        "max_queued_requests": state.bridge.admission.max_queue,
        "page_size": state.bridge.block_size,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "is_embedding": False,
        "disaggregation_mode": "null",
        "version": prefixcache.__version__,
        "engine": "prefixcache",
    }


def _model_info(state: ServerState) -> dict[str, Any]:
    """SGLang's ``/model_info``."""
    return {
        "model_path": state.model_name,
        "tokenizer_path": state.model_name,
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }


@router.get("/server_info", summary="The served model and limits (SGLang shape)")
async def server_info(request: Request) -> Any:
    return _server_info(get_state(request))


@router.get("/get_server_info", summary="The served model and limits (SGLang's older name)")
async def get_server_info(request: Request) -> Any:
    return _server_info(get_state(request))


@router.get("/model_info", summary="The served model (SGLang shape)")
async def model_info(request: Request) -> Any:
    return _model_info(get_state(request))


@router.get("/get_model_info", summary="The served model (SGLang's older name)")
async def get_model_info(request: Request) -> Any:
    return _model_info(get_state(request))


async def _loads(request: Request, include: str | None, model: str | None) -> Any:
    state = get_state(request)
    if model is not None:
        state.check_model(model)
    if include is not None:
        asked = {s.strip() for s in include.split(",") if s.strip()}
        unknown = sorted(asked - LOAD_SECTIONS)
        if unknown:
            raise bad_request(
                f"'include' names unknown sections {unknown[:4]}; use any of {sorted(LOAD_SECTIONS)}.",
                param="include",
            )
    snapshot = await state.snapshots.read("loads", lambda: current_load(state))
    if snapshot is None:
        raise cache_busy()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return sglang_loads(snapshot.value, stamp)


_INCLUDE = Query(None, description="Sections, comma-separated: core, disagg, queues, memory.")
_MODEL = Query(None, description="The served model (any other is a 404).")


@router.get("/v1/loads", summary="Requests running and waiting, KV cache use (SGLang shape)")
@router.get("/loads", summary="As GET /v1/loads")
@router.get("/get_loads", summary="As GET /v1/loads (SGLang's older name)")
async def loads(
    request: Request,
    include: str | None = _INCLUDE,
    model: str | None = _MODEL,
    tenant: Tenant = Depends(get_tenant),
) -> Any:
    return await _loads(request, include, model)
