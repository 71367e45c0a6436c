"""Anthropic-compatible routes: POST /v1/messages and POST /v1/messages/count_tokens.

Usage follows the hosted API: ``input_tokens`` counts the prompt tokens neither read from nor
written to the cache, so ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``
is the whole prompt. Streaming sends message_start, content_block_start, ping,
content_block_delta..., content_block_stop, message_delta (stop reason and the cumulative usage,
cache fields included), message_stop. ``message_start`` is sent once the prompt is prefilled, so
its usage already has the request's ``input_tokens``, ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` (clients such as LangChain read them there); ``message_delta``
repeats them with the final ``output_tokens``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.engine.types import ChoiceDelta, PromptDone
from prefixcache.server.anthropic_prompt import to_messages, ttl_plan
from prefixcache.server.auth import Tenant
from prefixcache.server.bridge import Finished, Usage
from prefixcache.server.errors import APIError, anthropic_error_body, bad_request
from prefixcache.server.routes_openai import SSE_HEADERS, _items, _start_stream
from prefixcache.server.schemas_anthropic import CountTokensRequest, MessagesRequest
from prefixcache.server.state import ServerState, get_state, get_tenant

router = APIRouter()


def anthropic_usage(
    u: Usage, plan: list[tuple[int, float]] | None = None, block_size: int = 16
) -> dict[str, Any]:
    """Hosted-API usage. ``cache_creation`` splits the written tokens by TTL class: the blocks
    written that end at or before a 1-hour breakpoint are the 1h class."""
    one_hour = 0
    for token_end, ttl in plan or ():
        if ttl >= 3600:
            covered = token_end // block_size * block_size
            one_hour = max(one_hour, min(u.cached_tokens + u.cache_write_tokens, covered) - u.cached_tokens)
    return {
        "input_tokens": u.uncached_unwritten_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.cache_write_tokens - one_hour,
            "ephemeral_1h_input_tokens": one_hour,
        },
        "output_tokens": u.completion_tokens,
    }


def stop_reason(fin: Finished) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if fin.finish_reason == "length":
        return "max_tokens", None
    if fin.stop_sequence:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _plan(
    state: ServerState, body: MessagesRequest
) -> tuple[list[dict[str, str]], list[tuple[int, float]]]:
    messages, breakpoints = to_messages(body)
    if not breakpoints:
        return messages, []
    full = await state.bridge.run(lambda: state.bridge.render_ids(messages))
    partial = state.bridge.render_ids_partial
    plan = await state.bridge.run(lambda: ttl_plan(messages, breakpoints, full, partial))
    return messages, plan


@router.post("/v1/messages", summary="Create a message (Anthropic shape)")
async def create_message(
    body: MessagesRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    if body.tools:
        raise bad_request("Tools are not supported by this server: remove 'tools'.", param="tools")
    messages, plan = await _plan(state, body)
    stops = list(body.stop_sequences or [])
    kwargs: dict[str, Any] = {
        "messages": messages,
        "max_tokens": body.max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "stop": stops or None,
        "tenant": tenant.name,
        "salt": tenant.salt,
    }
    if plan:
        kwargs["ttl_plan"] = plan
    longest = max((t for _, t in plan), default=None)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    text = {"messages": messages}
    if not body.stream:
        fin = await state.bridge.generate(kwargs, request.is_disconnected)
        state.record(request, tenant, fin, text, ttl_s=longest)
        reason, seq = stop_reason(fin)
        return JSONResponse(
            {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": state.model_name,
                "content": [{"type": "text", "text": fin.text}],
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": anthropic_usage(fin.usage, plan, state.bridge.block_size),
            }
        )
    # The first item is the engine's PromptDone (the prompt is prefilled): message_start carries
    # its usage; message_delta the cumulative usage at the end (the SDKs overwrite with it).
    agen, first = await _start_stream(state, kwargs, choices=True)

    async def events() -> AsyncIterator[str]:
        async for item in _items(agen, first):
            if isinstance(item, APIError):
                yield _event("error", anthropic_error_body(item))
                return
            if isinstance(item, PromptDone):
                message = {
                    "id": rid,
                    "type": "message",
                    "role": "assistant",
                    "model": state.model_name,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": anthropic_usage(item.usage, plan, state.bridge.block_size),
                }
                yield _event("message_start", {"type": "message_start", "message": message})
                block = {"type": "text", "text": ""}
                yield _event("content_block_start",
                             {"type": "content_block_start", "index": 0, "content_block": block})
                yield _event("ping", {"type": "ping"})
                continue
            if isinstance(item, ChoiceDelta):
                if item.text:
                    delta = {"type": "text_delta", "text": item.text}
                    yield _event("content_block_delta",
                                 {"type": "content_block_delta", "index": 0, "delta": delta})
                continue
            state.record(request, tenant, item, text, ttl_s=longest)
            reason, seq = stop_reason(item)
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            usage = anthropic_usage(item.usage, plan, state.bridge.block_size)
            usage.pop("cache_creation")
            yield _event(
                "message_delta",
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                 "usage": usage},
            )
            yield _event("message_stop", {"type": "message_stop"})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/messages/count_tokens", summary="Count a message's prompt tokens (Anthropic shape)")
async def count_tokens(
    body: CountTokensRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    messages, _ = to_messages(body)
    n = await state.bridge.run(lambda: len(state.bridge.render_ids(messages)))
    return JSONResponse({"input_tokens": n})
