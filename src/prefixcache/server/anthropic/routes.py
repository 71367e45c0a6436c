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

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.engine.types import ChoiceDelta, GenerationSpec, PromptDone
from prefixcache.server.anthropic.prompt import anthropic_tool_config, plan_for, to_messages
from prefixcache.server.anthropic.schemas import CountTokensRequest, MessagesRequest, PromptFields
from prefixcache.server.auth import Tenant
from prefixcache.server.bridge import Finished, Usage
from prefixcache.server.errors import APIError, anthropic_error_body
from prefixcache.server.generation import SSE_HEADERS, Generation, api_sampling, sse_event, with_prompt
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.openai.structured import compile_grammar, forced_tool_grammar
from prefixcache.server.ops.cache_reasons import prefixcache_field
from prefixcache.server.ops.diagnostics import compare, fingerprint
from prefixcache.server.state import ServerState, get_state, get_tenant
from prefixcache.server.tools.output import (
    CallsFound,
    anthropic_content,
    anthropic_tool_use,
    parse_reply,
    split_stream,
)
from prefixcache.server.tools.prompt import RenderedPrompt, ToolConfig, has_tool_turns

router = APIRouter(route_class=CheckedRoute)


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


def diagnostics_field(
    state: ServerState, body: MessagesRequest, tenant: Tenant, rid: str, usage: Usage
) -> dict[str, Any]:
    """``{"diagnostics": ...}`` when the request opted in (else empty), remembering this
    answer's fingerprint under ``rid`` for the caller's next turn."""
    if body.diagnostics is None:
        return {}
    now = fingerprint(body, usage.prompt_tokens)
    previous_id = body.diagnostics.previous_message_id
    result = None
    if previous_id is not None:
        previous = state.diagnostics.find(tenant.name, previous_id)
        align = getattr(state.bridge.engine, "alignment", None)
        result = compare(
            previous, now, usage, state.bridge.block_size, align if isinstance(align, int) else None
        )
    state.diagnostics.remember(tenant.name, rid, now)
    return {"diagnostics": result}


def stop_reason(fin: Finished, *, called: bool = False) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` (``called``: the reply made tool calls)."""
    if called:
        return "tool_use", None
    if fin.finish_reason == "length":
        return "max_tokens", None
    if fin.stop_sequence:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


class _ContentBlocks:
    """The content blocks of a streamed message: a text block (opened on demand), then one
    ``tool_use`` block per call (start, one ``input_json_delta``, stop)."""

    def __init__(self) -> None:
        self.index = 0
        self.text_open = False
        self.called = False

    def open_text(self) -> str:
        self.text_open = True
        start = {"type": "text", "text": ""}
        event = {"type": "content_block_start", "index": self.index, "content_block": start}
        return sse_event("content_block_start", event)

    def close(self) -> str:
        event = sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.index += 1
        self.text_open = False
        return event

    def tool_uses(self, found: CallsFound) -> list[str]:
        events = [self.close()] if self.text_open else []
        for call_id, call in found.calls:
            start = anthropic_tool_use(call_id, call, with_input=False)
            events.append(
                sse_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": self.index, "content_block": start},
                )
            )
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append(
                sse_event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": self.index, "delta": delta},
                )
            )
            events.append(self.close())
        self.called = True
        return events


async def _prompt(
    state: ServerState, body: PromptFields
) -> tuple[ToolConfig, RenderedPrompt, list[tuple[int, float]], list[int] | None]:
    """The request's tools, its rendered prompt, the TTL plan of its breakpoints and, when the
    plan needed them, the prompt's token ids (else None)."""
    config = anthropic_tool_config(body)
    conversation, breakpoints = to_messages(body)
    renderer = state.bridge.renderer(config)
    if not breakpoints and not config.tools and not has_tool_turns(conversation):
        return config, renderer.render(conversation), [], None  # plain chat: nothing to render here

    def build() -> tuple[RenderedPrompt, list[tuple[int, float]], list[int] | None]:
        rendered = renderer.render(conversation)
        if not breakpoints:
            return rendered, [], None
        full = state.bridge.prompt_ids(rendered)
        return rendered, plan_for(conversation, breakpoints, full, renderer, state.bridge.tokenize), full

    rendered, plan, ids = await state.bridge.run(build)
    return config, rendered, plan, ids


@router.post("/v1/messages", summary="Create a message (Anthropic shape)")
async def create_message(
    body: MessagesRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    config, rendered, plan, ids = await _prompt(state, body)
    temperature, top_p = api_sampling(body.temperature, body.top_p)
    sampling = GenerationSpec(
        max_tokens=body.max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=body.top_k or 0,
        tenant=tenant.name,
        salt=tenant.salt,
        ttl_plan=plan or None,
    )
    spec = with_prompt(sampling, rendered, body.stop_sequences)
    if ids is not None:  # tokenized for the plan: not again (router's block hashes, engine)
        spec = spec.with_prompt_ids(ids)
    grammar = await compile_grammar(state.bridge, forced_tool_grammar(config))  # tool_choice: a tool
    if grammar is not None:
        spec = replace(spec, grammar=grammar)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    gen = Generation(request, tenant, spec, rendered.trace_text())  # traced: the plan's longest TTL
    if not body.stream:
        fin = await gen.run()
        reply = parse_reply(fin.text, rendered, config)
        reason, seq = stop_reason(fin, called=bool(reply.calls))
        return JSONResponse(
            {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": state.model_name,
                "content": anthropic_content(reply),
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": anthropic_usage(fin.usage, plan, state.bridge.block_size),
                **prefixcache_field(fin.usage, state.bridge.decode),
                **diagnostics_field(state, body, tenant, rid, fin.usage),
            }
        )
    # The first item is the engine's PromptDone (the prompt is prefilled): message_start carries
    # its usage; message_delta the cumulative usage at the end (the SDKs overwrite with it).
    items = await gen.open_stream()

    async def events() -> AsyncIterator[str]:
        blocks = _ContentBlocks()
        async for item in split_stream(items, rendered, config, "toolu_"):
            if isinstance(item, APIError):
                yield sse_event("error", anthropic_error_body(item))
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
                    **prefixcache_field(item.usage, state.bridge.decode),
                    **diagnostics_field(state, body, tenant, rid, item.usage),
                }
                yield sse_event("message_start", {"type": "message_start", "message": message})
                if not config.parses_calls:  # the hosted order: the text block opens before the ping
                    yield blocks.open_text()
                yield sse_event("ping", {"type": "ping"})
                continue
            if isinstance(item, ChoiceDelta):  # the one choice: text (calls are taken out)
                if item.text:
                    if not blocks.text_open:
                        yield blocks.open_text()
                    delta = {"type": "text_delta", "text": item.text}
                    event = {"type": "content_block_delta", "index": blocks.index, "delta": delta}
                    yield sse_event("content_block_delta", event)
                continue
            if isinstance(item, CallsFound):
                for frame in blocks.tool_uses(item):
                    yield frame
                continue
            reason, seq = stop_reason(item, called=blocks.called)
            if not blocks.called:
                if not blocks.text_open:
                    yield blocks.open_text()
                yield blocks.close()
            usage = anthropic_usage(item.usage, plan, state.bridge.block_size)
            usage.pop("cache_creation")
            yield sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": usage,
                },
            )
            yield sse_event("message_stop", {"type": "message_stop"})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/messages/count_tokens", summary="Count a message's prompt tokens (Anthropic shape)")
async def count_tokens(
    body: CountTokensRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    _, rendered, _, ids = await _prompt(state, body)
    n = (
        len(ids)
        if ids is not None
        else await state.bridge.run(lambda: len(state.bridge.prompt_ids(rendered)))
    )
    return JSONResponse({"input_tokens": n})
