"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions.

Responses and the SSE stream follow the hosted API byte for byte in shape: ``data: {chunk}``
lines, ``data: [DONE]`` last, and with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with empty ``choices`` carries the usage.
``usage.prompt_tokens_details`` always has ``cached_tokens`` (read from the cache) and
``cache_write_tokens`` (prefilled and stored by this request).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.cache.policy import TTL_CLASSES
from prefixcache.server.auth import Tenant
from prefixcache.server.bridge import Finished, Usage, translate_error
from prefixcache.server.errors import APIError, bad_request, openai_error_body
from prefixcache.server.openai_prompt import chat_conversation, chat_tool_config
from prefixcache.server.schemas_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    _CachedGeneration,
    _Sampling,
)
from prefixcache.server.state import ServerState, get_state, get_tenant
from prefixcache.server.tool_output import (
    CallsFound,
    openai_call_deltas,
    openai_message,
    parse_reply,
    split_stream,
)
from prefixcache.server.tool_prompt import Message, RenderedPrompt, ToolConfig, has_tool_turns

log = logging.getLogger(__name__)
router = APIRouter()

DEFAULT_CHAT_MAX_TOKENS = 256
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def openai_usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def generation_kwargs(req: _CachedGeneration, tenant: Tenant) -> dict[str, Any]:
    """Engine keyword arguments of every OpenAI route: temperature, top_p, the caller's tenant
    and salt, and the TTL class of ``prompt_cache_retention``."""
    if req.temperature is not None and req.temperature > 0 and req.top_p is not None and req.top_p <= 0:
        raise bad_request("top_p must be in (0, 1].", param="top_p")
    kw: dict[str, Any] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tenant": tenant.name,
        "salt": tenant.salt,
    }
    if req.prompt_cache_retention is not None:
        kw["ttl_s"] = TTL_CLASSES[req.prompt_cache_retention]
    return kw


def sampling_kwargs(req: _Sampling, tenant: Tenant) -> dict[str, Any]:
    """Engine keyword arguments common to the chat and completions routes."""
    sampling = {"top_k": req.top_k or 0, "seed": req.seed, "stop": req.stop_list() or None}
    return {**generation_kwargs(req, tenant), **sampling}


async def render_prompt(
    state: ServerState, config: ToolConfig, conversation: list[Message]
) -> RenderedPrompt:
    """The request's prompt under its tools (in a worker thread when a template renders it)."""
    renderer = state.bridge.renderer(config)
    if not config.tools and not has_tool_turns(conversation):
        return renderer.render(conversation)  # plain chat: flat messages, the engine renders them
    return await state.bridge.run(lambda: renderer.render(conversation))


def prompt_kwargs(rendered: RenderedPrompt, stop: list[str] | None) -> dict[str, Any]:
    """``messages=`` / ``prompt=`` and the stop strings (the request's and the tools')."""
    stops = [*(stop or []), *rendered.stop]
    return {**rendered.engine_input(), "stop": stops or None}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _start_stream(state: ServerState, kwargs: dict[str, Any]) -> tuple[AsyncIterator[str | Finished], list[Any]]:
    """Open the engine stream and pull its first item, so a bad request or a full queue is
    still answered with a 4xx before the 200 and the first byte go out."""
    agen = state.bridge.stream(kwargs)
    first: list[Any] = []
    try:
        first.append(await agen.__anext__())
    except StopAsyncIteration:
        pass
    except BaseException:
        await agen.aclose()
        raise
    return agen, first


async def _items(agen: AsyncIterator[str | Finished], first: list[Any]) -> AsyncIterator[str | Finished | APIError]:
    """The stream's items; a failure after the 200 went out becomes a last :class:`APIError`
    item, which the route sends as an error event (the status can no longer change)."""
    for item in first:
        yield item
    try:
        async for item in agen:
            yield item
    except Exception as exc:
        api = translate_error(exc)
        if api is None:
            log.exception("a stream failed after it started")
            api = APIError(500, f"The generation failed ({type(exc).__name__}); see the server log.")
        yield api


@router.post("/v1/chat/completions", summary="Chat completion (OpenAI shape)")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    config = chat_tool_config(body)
    rendered = await render_prompt(state, config, chat_conversation(body.messages))
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    sampling = sampling_kwargs(body, tenant)
    kwargs = {**sampling, **prompt_kwargs(rendered, sampling["stop"]), "max_tokens": max_tokens}
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    text = rendered.trace_text()
    if not body.stream:
        fin = await state.bridge.generate(kwargs, request.is_disconnected)
        state.record(request, tenant, fin, text, kwargs.get("ttl_s"), body.prompt_cache_key)
        reply = parse_reply(fin.text, rendered, config)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": state.model_name,
                "system_fingerprint": None,
                "choices": [
                    {
                        "index": 0,
                        "message": openai_message(reply),
                        "logprobs": None,
                        "finish_reason": "tool_calls" if reply.calls else fin.finish_reason,
                    }
                ],
                "usage": openai_usage(fin.usage),
            }
        )
    agen, first = await _start_stream(state, kwargs)
    include_usage = body.include_usage

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        c: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            c["usage"] = None
        return c

    async def events() -> AsyncIterator[str]:
        yield _sse(chunk({"role": "assistant", "content": ""}, None))
        called = False
        async for item in split_stream(_items(agen, first), rendered, config, "call_"):
            if isinstance(item, APIError):
                yield _sse(openai_error_body(item))
                return
            if isinstance(item, str):
                yield _sse(chunk({"content": item}, None))
                continue
            if isinstance(item, CallsFound):
                called = True
                for delta in openai_call_deltas(item):
                    yield _sse(chunk(delta, None))
                continue
            state.record(request, tenant, item, text, kwargs.get("ttl_s"), body.prompt_cache_key)
            yield _sse(chunk({}, "tool_calls" if called else item.finish_reason))
            if include_usage:
                final = chunk({}, None)
                final["choices"] = []
                final["usage"] = openai_usage(item.usage)
                yield _sse(final)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/completions", summary="Text completion (OpenAI shape)")
async def completions(body: CompletionRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    if body.echo:
        raise bad_request("'echo' is not supported: remove it or set it to false.", param="echo")
    if body.suffix:
        raise bad_request("'suffix' is not supported: remove it.", param="suffix")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty: send at least one character.", param="prompt")
        kwargs: dict[str, Any] = {"prompt": prompt}
        text: dict[str, Any] = {"prompt": prompt}
    else:
        kwargs = {"prompt_token_ids": list(prompt)}
        text = {}
    kwargs.update(max_tokens=body.max_tokens or 16, **sampling_kwargs(body, tenant))
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if not body.stream:
        fin = await state.bridge.generate(kwargs, request.is_disconnected)
        state.record(request, tenant, fin, text, kwargs.get("ttl_s"), body.prompt_cache_key)
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "system_fingerprint": None,
                "choices": [{"text": fin.text, "index": 0, "logprobs": None, "finish_reason": fin.finish_reason}],
                "usage": openai_usage(fin.usage),
            }
        )
    agen, first = await _start_stream(state, kwargs)
    include_usage = body.include_usage

    def chunk(text_delta: str, finish: str | None) -> dict[str, Any]:
        c: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "system_fingerprint": None,
            "choices": [{"text": text_delta, "index": 0, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            c["usage"] = None
        return c

    async def events() -> AsyncIterator[str]:
        async for item in _items(agen, first):
            if isinstance(item, APIError):
                yield _sse(openai_error_body(item))
                return
            if isinstance(item, str):
                yield _sse(chunk(item, None))
                continue
            state.record(request, tenant, item, text, kwargs.get("ttl_s"), body.prompt_cache_key)
            yield _sse(chunk("", item.finish_reason))
            if include_usage:
                final = chunk("", None)
                final["choices"] = []
                final["usage"] = openai_usage(item.usage)
                yield _sse(final)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
