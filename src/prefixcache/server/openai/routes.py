"""OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions.

Responses and the SSE stream follow the hosted API byte for byte in shape: ``data: {chunk}``
lines, ``data: [DONE]`` last, and with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with empty ``choices`` carries the usage.
``usage.prompt_tokens_details`` always has ``cached_tokens`` (read from the cache) and
``cache_write_tokens`` (prefilled and stored by this request).

``n`` choices decode from one prefill of the prompt; usage counts the prompt once and sums the
choices' tokens. In a stream every chunk names its choice by ``index``, and each choice ends
with its own ``finish_reason`` chunk. ``logprobs`` (chat: ``logprobs`` + ``top_logprobs``;
completions: ``logprobs`` = k) come in OpenAI's shapes (``server/openai/logprobs.py``), also streamed.
With ``tools`` each chat choice's reply is parsed for its own calls (``tool_output``);
``logprobs`` together with parsed calls is a 400 naming ``logprobs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.cache.config import TTL_CLASSES
from prefixcache.engine.types import ChoiceDelta, GenerationSpec, PromptDone
from prefixcache.server.auth import Tenant
from prefixcache.server.bridge import Usage
from prefixcache.server.errors import APIError, bad_request, openai_error_body
from prefixcache.server.generation import (
    SSE_DONE,
    SSE_HEADERS,
    Generation,
    api_sampling,
    sse_data,
    with_prompt,
)
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.openai.logprobs import chat_logprobs, completion_logprobs
from prefixcache.server.openai.prompt import chat_conversation, chat_tool_config
from prefixcache.server.openai.prompt_logprobs import (
    echo_logprobs,
    join_logprobs,
    prompt_entries,
    trim_top,
    vllm_prompt_logprobs,
)
from prefixcache.server.openai.schemas import (
    CachedGeneration,
    ChatCompletionRequest,
    CompletionRequest,
    Sampling,
)
from prefixcache.server.openai.structured import compile_grammar, forced_tool_grammar, requested_grammar
from prefixcache.server.ops.cache_reasons import prefixcache_field
from prefixcache.server.state import ServerState, get_state, get_tenant
from prefixcache.server.tools.output import (
    CallsFound,
    openai_call_deltas,
    openai_message,
    parse_reply,
    split_stream,
)
from prefixcache.server.tools.prompt import Message, RenderedPrompt, ToolConfig, has_tool_turns

router = APIRouter(route_class=CheckedRoute)

DEFAULT_CHAT_MAX_TOKENS = 256


def openai_usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens,
        },
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    """What every chunk of one chat or completions stream repeats (id, object, created, model, a
    null system_fingerprint) and ``stream_options.include_usage``: with it, every chunk carries
    ``"usage": null`` and the stream's last chunk (:meth:`usage_chunk`, no choices) the usage."""

    id: str
    object: str
    created: int
    model: str
    include_usage: bool

    def head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """One chunk of one choice."""
        c = {**self.head(), "choices": [choice]}
        if self.include_usage:
            c["usage"] = None
        return c

    def usage_chunk(self, usage: Usage, decode: Callable[[list[int]], str]) -> dict[str, Any]:
        """The last chunk with ``include_usage``: empty ``choices``, the usage, the miss reason."""
        return {
            **self.head(),
            "choices": [],
            "usage": openai_usage(usage),
            **prefixcache_field(usage, decode),
        }


def generation_spec(req: CachedGeneration, tenant: Tenant) -> GenerationSpec:
    """What every OpenAI route asks of the engine: temperature, top_p, the caller's tenant and
    salt, and the TTL class of ``prompt_cache_retention`` (no prompt yet)."""
    if req.temperature is not None and req.temperature > 0 and req.top_p is not None and req.top_p <= 0:
        raise bad_request("top_p must be in (0, 1].", param="top_p")
    retention = req.prompt_cache_retention
    temperature, top_p = api_sampling(req.temperature, req.top_p)
    return GenerationSpec(
        temperature=temperature,
        top_p=top_p,
        tenant=tenant.name,
        salt=tenant.salt,
        ttl_s=TTL_CLASSES[retention] if retention is not None else None,
    )


def sampling_spec(req: Sampling, tenant: Tenant) -> GenerationSpec:
    """:func:`generation_spec` with the sampling fields of the chat and completions routes."""
    return replace(
        generation_spec(req, tenant), top_k=req.top_k or 0, seed=req.seed, stop=req.stop_list() or None
    )


def choices_count(state: ServerState, req: Sampling) -> int:
    """The request's ``n``, or a 400 naming ``n`` above what this server decodes side by side."""
    n = req.n or 1
    if n > state.bridge.max_n:
        raise bad_request(
            f"'n' may be at most {state.bridge.max_n} on this server (its --max-batch); got {n}.", param="n"
        )
    return n


async def render_prompt(
    state: ServerState, config: ToolConfig, conversation: list[Message]
) -> RenderedPrompt:
    """The request's prompt under its tools (in a worker thread when a template renders it)."""
    renderer = state.bridge.renderer(config)
    if not config.tools and not has_tool_turns(conversation):
        return renderer.render(conversation)  # plain chat: flat messages, the engine renders them
    return await state.bridge.run(lambda: renderer.render(conversation))


@router.post("/v1/chat/completions", summary="Chat completion (OpenAI shape)")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    config = chat_tool_config(body)
    n = choices_count(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    if body.logprobs and config.parses_calls:
        raise bad_request(
            "'logprobs' with 'tools' is not supported: a reply's tool calls are parsed out of its "
            "tokens, so the logprobs would not match the content. Drop 'logprobs', or send "
            "'tool_choice': 'none'.",
            param="logprobs",
        )
    top = (body.top_logprobs or 0) if body.logprobs else None
    rendered = await render_prompt(state, config, chat_conversation(body.messages))
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    sampling = sampling_spec(body, tenant)
    spec = replace(with_prompt(sampling, rendered, sampling.stop), max_tokens=max_tokens, n=n, logprobs=top)
    ask = requested_grammar(body)
    if ask is not None and config.parses_calls:
        raise bad_request(
            f"'{ask[2]}' with 'tools' is not supported: send 'tool_choice': 'none' or drop one of them.",
            param=ask[2],
        )
    grammar = await compile_grammar(state.bridge, ask or forced_tool_grammar(config))
    if grammar is not None:
        spec = replace(spec, grammar=grammar)
    vllm_part: list[Any] | None = None
    if body.prompt_logprobs is not None:  # vLLM's extension: the prompt's rows, recomputed
        if body.stream:
            raise bad_request(
                "'prompt_logprobs' is not supported with 'stream': drop one of them.", param="prompt_logprobs"
            )
        ids, entries = await prompt_entries(state.bridge, spec, body.prompt_logprobs)
        vllm_part = vllm_prompt_logprobs(entries, state.bridge.token_text)
        spec = spec.with_prompt_ids(ids)  # tokenized once, here
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    tokens = state.bridge.token_text
    gen = Generation(request, tenant, spec, rendered.trace_text(), body.prompt_cache_key)
    if not body.stream:
        fin = await gen.run()
        choices = []
        for c in fin.choices:  # the calls are parsed from each choice's own text
            reply = parse_reply(c.text, rendered, config)
            choices.append(
                {
                    "index": c.index,
                    "message": openai_message(reply),
                    "logprobs": chat_logprobs(c.logprobs, tokens) if c.logprobs is not None else None,
                    "finish_reason": "tool_calls" if reply.calls else c.finish_reason,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": state.model_name,
                "system_fingerprint": None,
                "choices": choices,
                "usage": openai_usage(fin.usage),
                **({"prompt_logprobs": vllm_part} if vllm_part is not None else {}),
                **prefixcache_field(fin.usage, state.bridge.decode),
            }
        )
    items = await gen.open_stream()
    frame = ChunkFrame(rid, "chat.completion.chunk", created, state.model_name, body.include_usage)

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        return frame.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    async def events() -> AsyncIterator[str]:
        for index in range(n):
            yield sse_data(chunk(index, {"role": "assistant", "content": ""}, None))
        called: set[int] = set()  # the choices that made tool calls
        async for item in split_stream(items, rendered, config, "call_"):
            if isinstance(item, APIError):
                yield sse_data(openai_error_body(item))
                return
            if isinstance(item, PromptDone):
                continue
            if isinstance(item, ChoiceDelta):
                if item.text or item.logprobs:
                    lp = chat_logprobs(item.logprobs, tokens) if top is not None else None
                    yield sse_data(chunk(item.index, {"content": item.text}, None, lp))
                if item.finish_reason:
                    finish = "tool_calls" if item.index in called else item.finish_reason
                    yield sse_data(chunk(item.index, {}, finish))
                continue
            if isinstance(item, CallsFound):
                called.add(item.index)
                for delta in openai_call_deltas(item):
                    yield sse_data(chunk(item.index, delta, None))
                continue
            if frame.include_usage:  # the Finished (recorded as it passed)
                yield sse_data(frame.usage_chunk(item.usage, state.bridge.decode))
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/completions", summary="Text completion (OpenAI shape)")
async def completions(body: CompletionRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    if body.suffix:
        raise bad_request("'suffix' is not supported: remove it.", param="suffix")
    n = choices_count(state, body)
    if body.best_of is not None and body.best_of != n:
        raise bad_request(
            "'best_of' is not supported: every choice is returned; remove it or set it equal to 'n'.",
            param="best_of",
        )
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty: send at least one character.", param="prompt")
        source = GenerationSpec(prompt=prompt)
        text: dict[str, Any] = {"prompt": prompt}
    else:
        ids_in = [int(t) for t in prompt]  # (the schema's third form: ints)
        source = GenerationSpec(prompt_token_ids=ids_in)
        text = {}
        _check_vocabulary(state, ids_in)  # before any decode (echo) sees them
    echo = ""
    if body.echo:
        ids = list(source.prompt_token_ids or [])
        echo = prompt if isinstance(prompt, str) else await state.bridge.run(lambda: state.bridge.decode(ids))
    tokens = state.bridge.token_text
    # The prompt's own logprobs (echo + logprobs, or vLLM's prompt_logprobs): its rows recomputed
    # with the cache bypassed, before the generation (so a bad request fails first).
    prompt_part: dict[str, Any] | None = None
    vllm_part: list[Any] | None = None
    if (body.echo and body.logprobs is not None) or body.prompt_logprobs is not None:
        if body.stream and body.prompt_logprobs is not None:
            raise bad_request(
                "'prompt_logprobs' is not supported with 'stream': drop one of them.", param="prompt_logprobs"
            )
        prompt_ids, entries = await prompt_entries(
            state.bridge, source, max(body.logprobs or 0, body.prompt_logprobs or 0)
        )
        if body.echo and body.logprobs is not None:
            prompt_part = echo_logprobs(prompt_ids, trim_top(entries, body.logprobs), tokens)
        if body.prompt_logprobs is not None:
            vllm_part = vllm_prompt_logprobs(trim_top(entries, body.prompt_logprobs), tokens)
        source = source.with_prompt_ids(prompt_ids)  # tokenized once, here
    spec = replace(
        sampling_spec(body, tenant),
        prompt=source.prompt,
        prompt_token_ids=source.prompt_token_ids,
        max_tokens=body.max_tokens or 16,
        n=n,
        logprobs=body.logprobs,
    )
    grammar = await compile_grammar(state.bridge, requested_grammar(body))
    if grammar is not None:
        spec = replace(spec, grammar=grammar)
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    def logprobs(entries: Any) -> Any:
        return completion_logprobs(entries, tokens, len(echo)) if entries is not None else None

    def choice_logprobs(entries: Any) -> Any:
        out = logprobs(entries)
        return join_logprobs(prompt_part, out) if prompt_part is not None else out

    def extra(choice: dict[str, Any]) -> dict[str, Any]:
        if vllm_part is not None:
            choice["prompt_logprobs"] = vllm_part
        return choice

    gen = Generation(request, tenant, spec, text, body.prompt_cache_key)
    if not body.stream:
        fin = await gen.run()
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "system_fingerprint": None,
                "choices": [
                    extra(
                        {
                            "text": echo + c.text,
                            "index": c.index,
                            "logprobs": choice_logprobs(c.logprobs),
                            "finish_reason": c.finish_reason,
                        }
                    )
                    for c in fin.choices
                ],
                "usage": openai_usage(fin.usage),
                **prefixcache_field(fin.usage, state.bridge.decode),
            }
        )
    items = await gen.open_stream()
    frame = ChunkFrame(rid, "text_completion", created, state.model_name, body.include_usage)

    def chunk(index: int, text_delta: str, finish: str | None, lp: Any = None) -> dict[str, Any]:
        return frame.chunk({"text": text_delta, "index": index, "logprobs": lp, "finish_reason": finish})

    async def events() -> AsyncIterator[str]:
        for index in range(n if echo else 0):
            yield sse_data(chunk(index, echo, None, prompt_part))
        async for item in items:
            if isinstance(item, APIError):
                yield sse_data(openai_error_body(item))
                return
            if isinstance(item, PromptDone):
                continue
            if isinstance(item, ChoiceDelta):
                if item.text or item.logprobs:
                    lp = logprobs(item.logprobs) if body.logprobs is not None else None
                    yield sse_data(chunk(item.index, item.text, None, lp))
                if item.finish_reason:
                    yield sse_data(chunk(item.index, "", item.finish_reason))
                continue
            if frame.include_usage:  # the Finished (recorded as it passed)
                yield sse_data(frame.usage_chunk(item.usage, state.bridge.decode))
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _check_vocabulary(state: Any, ids: list[int]) -> None:
    """400 naming ``prompt`` for a token id outside the model's vocabulary (a tokenizer's decode
    overflows on ids past 32 bits)."""
    vocab = getattr(getattr(state.engine, "runner", None), "vocab_size", None)
    if vocab is None:
        return
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"'prompt' holds token id {bad}, outside the vocabulary (0..{vocab - 1}).",
            param="prompt",
            code="invalid_token_id",
        )
