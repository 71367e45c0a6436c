"""Operations routes: GET /health, GET /v1/models, GET /metrics, and the caller's cache:
GET/DELETE /v1/cache, POST/DELETE /v1/cache/pin, GET /v1/cache/report."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from prefixcache.cache.pins import TenantPinBudgetExceeded
from prefixcache.cache.store import PinBudgetExceeded
from prefixcache.engine.types import GenerationSpec
from prefixcache.server.auth import Tenant
from prefixcache.server.errors import APIError, bad_request
from prefixcache.server.generation import record
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.openai.prompt import chat_conversation, chat_tool_config
from prefixcache.server.openai.schemas import ChatCompletionRequest, ChatMessage, ChatTool
from prefixcache.server.ops.snapshots import Snapshot
from prefixcache.server.state import get_state, get_tenant

router = APIRouter(route_class=CheckedRoute)
_STARTED = int(time.time())

#: Per-tenant fields of CacheStats (the others describe the whole store, i.e. other tenants).
TENANT_FIELDS = (
    "tenant",
    "requests",
    "queried_tokens",
    "hit_tokens",
    "written_tokens",
    "hit_rate",
    "blocks",
    "bytes",
    "hits_by_outcome",
)


class PinRequest(BaseModel):
    """The prefix to keep warm: chat ``messages`` (OpenAI shape, rendered as a chat prompt
    without the assistant turn), a raw ``prompt`` or ``prompt_token_ids``; exactly one. With
    ``messages``, ``tools`` (OpenAI chat function tools) are rendered as a chat request with those
    tools renders them, so an agent's tool definitions and system prompt can be kept warm."""

    model_config = ConfigDict(extra="ignore")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    prompt: Annotated[StrictStr, Field(min_length=1)] | None = None
    prompt_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None = None


#: Set on an answer read from an earlier snapshot: how old it is (the cache lock was busy).
STALE_HEADER = "x-prefixcache-snapshot-age"


def cache_busy() -> APIError:
    return APIError(
        503,
        "The cache is busy (a tier read holds it); retry in a moment.",
        code="cache_busy",
        headers={"retry-after": "1"},
    )


def _age_headers(snapshot: Snapshot) -> dict[str, str] | None:
    return {STALE_HEADER: f"{snapshot.age_s:.3f}"} if snapshot.stale else None


@router.get("/health", summary="Liveness")
async def health(request: Request) -> Any:
    """Never touches the cache (nor its lock): it answers while a tier read stalls the cache."""
    state = get_state(request)
    auditor = getattr(state.engine, "auditor", None)
    degraded = auditor is not None and auditor.degraded
    out: dict[str, Any] = {
        "status": "degraded" if degraded else "ok",
        "model": state.model_name,
        "queue_depth": state.bridge.admission.depth,
    }
    if degraded:  # the exactness audit found a hit that differs (see GET /v1/cache/verify)
        out["degraded"] = ["exactness: a cache hit differed from its recomputation; see GET /v1/cache/verify"]
    return out


@router.get("/v1/models", summary="The served model (OpenAI and Anthropic list shapes at once)")
async def models(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    name = get_state(request).model_name
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_STARTED))
    entry = {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "prefixcache",
        "root": name,
        "parent": None,
        "max_model_len": int(getattr(get_state(request).engine, "context_len", 0) or 0),
        "type": "model",
        "display_name": name,
        "created_at": created,
    }
    return {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Rendered off the loop (the cache collector takes the cache lock); while the lock is busy,
    the last rendering, with its age in ``x-prefixcache-snapshot-age``."""
    state = get_state(request)
    snapshot = await state.snapshots.read("metrics", state.metrics.render)
    if snapshot is None:
        raise cache_busy()
    return Response(
        snapshot.value, media_type="text/plain; version=0.0.4; charset=utf-8", headers=_age_headers(snapshot)
    )


@router.get("/v1/cache", summary="The caller's cache statistics")
async def cache_stats(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """Read off the loop, as /metrics (a stale answer carries ``x-prefixcache-snapshot-age``)."""
    state = get_state(request)
    cache = state.bridge.cache
    if cache is None:
        raise APIError(400, "The prompt cache is disabled on this server.", code="cache_disabled")

    def read() -> dict[str, Any]:
        stats = cache.stats(tenant.name).as_dict()
        out = {k: stats[k] for k in TENANT_FIELDS if k in stats}
        auditor = getattr(state.engine, "auditor", None)
        if auditor is not None:  # the exactness audit's counts (the server's, not per tenant)
            out["verified"] = auditor.counts()
            out["verify_degraded"] = auditor.degraded
        return out

    snapshot = await state.snapshots.read(("tenant", tenant.name), read)
    if snapshot is None:
        raise cache_busy()
    return JSONResponse(snapshot.value, headers=_age_headers(snapshot))


@router.delete("/v1/cache", summary="Flush the caller's cached blocks, in memory and in the tiers below")
async def cache_flush(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """Memory (blocks in use or pinned stay), then every entry of the caller's namespace in the
    disk and Redis tiers (``tier_entries_removed``: per tier). Other tenants' entries stay."""
    bridge = get_state(request).bridge
    ns = bridge.namespace(tenant.name, tenant.salt)
    removed = await bridge.run(lambda: bridge.enabled_cache.flush(ns))
    tiers = await bridge.run(lambda: bridge.enabled_cache.remove_tier_entries(ns))
    return {"flushed_blocks": removed, "tier_entries_removed": tiers}


def _prefix_kwargs(body: PinRequest) -> dict[str, Any]:
    given = [k for k in ("messages", "prompt", "prompt_token_ids") if getattr(body, k) is not None]
    if len(given) != 1:
        raise bad_request("Send exactly one of 'messages', 'prompt' or 'prompt_token_ids'.")
    if body.messages is not None:
        return {"messages": [{"role": m.role, "content": m.text()} for m in body.messages]}
    if body.prompt is not None:
        return {"prompt": body.prompt}
    return {"prompt_token_ids": list(body.prompt_token_ids or [])}


async def prefix_ids(request: Request, body: PinRequest) -> list[int]:
    bridge = get_state(request).bridge
    kw = _prefix_kwargs(body)
    if body.tools is not None:
        if "messages" not in kw:
            raise bad_request("'tools' needs 'messages' (the system prefix they go with).", param="tools")
        chat = ChatCompletionRequest.model_construct(model="", messages=body.messages or [], tools=body.tools)
        renderer = bridge.renderer(chat_tool_config(chat))
        conversation = chat_conversation(body.messages or [])
        text = await bridge.run(lambda: renderer.text(conversation, add_generation_prompt=False))
        return await bridge.run(lambda: list(bridge.engine.tokenize(text)))
    if "messages" in kw:
        return await bridge.run(lambda: bridge.render_ids(kw["messages"], add_generation_prompt=False))
    if "prompt" in kw:
        return await bridge.run(lambda: list(bridge.engine.tokenize(kw["prompt"])))
    ids = kw["prompt_token_ids"]
    vocab = bridge.engine.runner.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:  # before the cache packs them (a 64-bit id overflowed there: a 500)
        raise bad_request(
            f"token id {bad} is outside the vocabulary (0 to {vocab - 1}).", param="prompt_token_ids"
        )
    return ids


@router.post("/v1/cache/pin", summary="Prefill a prefix and keep it warm (no expiry, no eviction)")
async def cache_pin(body: PinRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    state = get_state(request)
    bridge = state.bridge
    ns = bridge.namespace(tenant.name, tenant.salt)
    ids = await prefix_ids(request, body)
    if len(ids) < bridge.block_size:  # not one full block: there would be nothing to pin
        raise APIError(
            400,
            f"The prefix is {len(ids)} tokens, shorter than one cache block ({bridge.block_size} tokens): "
            "nothing can be pinned. Pin the long shared start of your prompts (a system prompt, tools).",
            param="prompt",
            code="prefix_too_short",
        )
    # Prefill (one token generated) so that every full block of the prefix is cached, then pin.
    fin = await bridge.generate(
        GenerationSpec(
            prompt_token_ids=ids, max_tokens=1, temperature=0.0, tenant=tenant.name, salt=tenant.salt
        )
    )
    record(state, request, tenant, fin, None)
    try:
        pinned = await bridge.run(lambda: bridge.enabled_cache.pin(ids, ns))
    except TenantPinBudgetExceeded as e:
        message = (
            f"This tenant's share of the pinned budget is full: {e.used} of its {e.limit} bytes are pinned "
            f"(the server's --tenant-pin-share is {e.share:g}) and this prefix needs {e.needed} more; "
            "unpin one of your prefixes first (DELETE /v1/cache/pin)."
        )
        raise APIError(409, message, code="tenant_pin_budget") from e
    except PinBudgetExceeded as e:
        message = f"The pinned budget is full ({e}); unpin another prefix first."
        raise APIError(409, message, code="pin_budget") from e
    return JSONResponse({"pinned_tokens": pinned, "prompt_tokens": len(ids)})


@router.delete("/v1/cache/pin", summary="Unpin a prefix (it expires and is evicted normally again)")
async def cache_unpin(body: PinRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    bridge = get_state(request).bridge
    ns = bridge.namespace(tenant.name, tenant.salt)
    ids = await prefix_ids(request, body)
    unpinned = await bridge.run(lambda: bridge.enabled_cache.unpin(ids, ns))
    return {"unpinned_tokens": unpinned}


@router.get("/v1/cache/report", summary="Cache busting found live in the caller's traffic")
async def cache_report(request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """The caller's endpoints and their busting findings over the live window (the audit's
    ``busting`` rows; see :mod:`~prefixcache.server.ops.busting`). Never another tenant's."""
    watch = get_state(request).busting
    if watch is None:
        raise APIError(
            400,
            "The live cache-busting watch is off on this server (--busting-window 0).",
            code="report_disabled",
        )
    state = get_state(request)
    report = await asyncio.to_thread(watch.live.report, tenant.name)
    return state.caller_text.busting_report(tenant, report) if state.caller_text is not None else report
