"""vLLM's token routes, which routers call to learn a request's tokens before they route it:
POST /tokenize, POST /detokenize, and the render routes POST /v1/chat/completions/render,
/v1/completions/render, /v1/messages/render and /v1/responses/render.

A render takes the body its generation route takes (same schema, same 4xx) and answers vLLM's
``GenerateRequest`` shape (``vllm/entrypoints/scale_out/render``): ``token_ids`` are exactly the
tokens that generation would prefill (the same renderer, tools included), plus the sampling
parameters it would use. ``/v1/completions/render`` answers a list (one entry per prompt, as
vLLM does). Nothing here reads or writes the cache, and every route needs the caller's key, as
generation does. A render never says anything about the cache: ``cache_salt`` is the request's
own (null when it sent none), never the tenant's salt.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from prefixcache.server.anthropic.prompt import anthropic_tool_config, to_messages
from prefixcache.server.anthropic.schemas import MessagesRequest
from prefixcache.server.auth import Tenant
from prefixcache.server.errors import bad_request
from prefixcache.server.generation import api_sampling
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.openai.prompt import chat_conversation, chat_tool_config, responses_conversation
from prefixcache.server.openai.prompt import responses_tool_config as responses_tools
from prefixcache.server.openai.responses import refuse_unsupported
from prefixcache.server.openai.routes import DEFAULT_CHAT_MAX_TOKENS, choices_count, render_prompt
from prefixcache.server.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    NamedToolChoice,
)
from prefixcache.server.openai.schemas_responses import ResponsesRequest
from prefixcache.server.state import ServerState, get_state, get_tenant
from prefixcache.server.tools.prompt import RenderedPrompt, has_tool_turns

router = APIRouter(route_class=CheckedRoute)


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest``
    (``messages``, with ``tools``); exactly one of the two."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Any = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def _check_optional_model(state: ServerState, model: str | None) -> None:
    if model is not None:
        state.check_model(model)


async def _ids(state: ServerState, rendered: RenderedPrompt) -> list[int]:
    """The token ids generation prefills for this rendered prompt (off the loop)."""
    return list(await state.bridge.run(lambda: state.bridge.prompt_ids(rendered)))


def _sampling_params(body: Any, max_tokens: int, stop: list[str], n: int = 1) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` fields that this server applies, as a generation would."""
    temperature, top_p = api_sampling(getattr(body, "temperature", None), getattr(body, "top_p", None))
    return {
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": getattr(body, "top_k", None) or 0,
        "seed": getattr(body, "seed", None),
        "stop": stop,
        "stop_token_ids": [],
        "max_tokens": max_tokens,
        "logprobs": None,
        "prompt_logprobs": None,
        "skip_special_tokens": True,
    }


def _generate_request(
    rid: str, ids: list[int], model: str, params: dict[str, Any], stream: bool, options: Any
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` as its render routes dump it."""
    return {
        "request_id": rid,
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "sampling_params": params,
        "model": model,
        "stream": stream,
        "stream_options": options if stream else None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }


def _stops(body: Any, rendered: RenderedPrompt | None = None) -> list[str]:
    stop_list = getattr(body, "stop_list", None)
    own = list(stop_list() or []) if stop_list is not None else []
    return [*own, *(rendered.stop if rendered is not None else ())]


def _options(body: Any) -> Any:
    options = getattr(body, "stream_options", None)
    return options.model_dump() if isinstance(options, BaseModel) else options


@router.post("/tokenize", summary="Token ids of a prompt or of chat messages (vLLM shape)")
async def tokenize(body: TokenizeRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    """``{"count", "max_model_len", "tokens", "token_strs"}``: the tokens generation prefills
    (chat messages are rendered as ``/v1/chat/completions`` renders them)."""
    state = get_state(request)
    _check_optional_model(state, body.model)
    bridge = state.bridge
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of 'prompt' or 'messages'.")
    if body.prompt is not None:
        prompt = body.prompt
        ids = list(await bridge.run(lambda: bridge.tokenize(prompt)))
    else:
        chat = ChatCompletionRequest(
            model=state.model_name,
            messages=body.messages or [],
            tools=body.tools,
            tool_choice=_tool_choice(body.tool_choice),
        )
        config = chat_tool_config(chat)
        conversation = chat_conversation(chat.messages)
        if not body.add_generation_prompt:
            if config.tools or has_tool_turns(conversation):
                raise bad_request(
                    "'add_generation_prompt': false is only supported without tools and tool turns.",
                    param="add_generation_prompt",
                )
            flat = [{"role": m["role"], "content": m["content"]} for m in conversation]
            ids = list(await bridge.run(lambda: bridge.render_ids(flat, add_generation_prompt=False)))
        else:
            ids = await _ids(state, await render_prompt(state, config, conversation))
    strs = None
    if body.return_token_strs:
        pieces = bridge.token_text
        strs = [pieces.text(i) for i in ids]
    return {
        "count": len(ids),
        "max_model_len": int(getattr(state.engine, "context_len", 0)),
        "tokens": ids,
        "token_strs": strs,
    }


def _tool_choice(raw: Any) -> Any:
    """``tool_choice`` of a tokenize request, checked as chat checks it."""
    if raw is None or raw in ("none", "auto", "required"):
        return raw
    if isinstance(raw, dict):
        try:
            return NamedToolChoice.model_validate(raw)
        except ValueError as e:
            raise bad_request("'tool_choice' is not a valid named tool choice.", param="tool_choice") from e
    raise bad_request("'tool_choice' must be none, auto, required or a named function.", param="tool_choice")


@router.post("/detokenize", summary="The text of token ids (vLLM shape)")
async def detokenize(body: DetokenizeRequest, request: Request, tenant: Tenant = Depends(get_tenant)) -> Any:
    state = get_state(request)
    _check_optional_model(state, body.model)
    tokens = list(body.tokens)
    _check_vocab(state, tokens, "tokens")
    return {"prompt": await state.bridge.run(lambda: state.bridge.decode(tokens))}


def _check_vocab(state: ServerState, ids: list[int], field: str) -> None:
    """A 400 naming the first token id outside the model's vocabulary."""
    vocab = _vocab_size(state)
    for i, t in enumerate(ids):
        if vocab is not None and t >= vocab:
            raise bad_request(
                f"'{field}[{i}]' is {t}, outside this model's vocabulary of {vocab} tokens.",
                param=f"{field}[{i}]",
            )


def _vocab_size(state: ServerState) -> int | None:
    runner = getattr(state.engine, "runner", None)
    size = getattr(runner, "vocab_size", None)
    if size is None:
        tokenizer = getattr(state.engine, "tokenizer", None)
        size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    return int(size) if size is not None else None


@router.post("/v1/chat/completions/render", summary="The tokens a chat completion would prefill (vLLM shape)")
async def render_chat(
    body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    config = chat_tool_config(body)
    n = choices_count(state, body)
    rendered = await render_prompt(state, config, chat_conversation(body.messages))
    ids = await _ids(state, rendered)
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    params = _sampling_params(body, max_tokens, _stops(body, rendered), n)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    return _generate_request(rid, ids, body.model, params, bool(body.stream), _options(body))


@router.post("/v1/completions/render", summary="The tokens a text completion would prefill (vLLM shape)")
async def render_completion(
    body: CompletionRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    n = choices_count(state, body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty: send at least one character.", param="prompt")
        text = prompt
        ids = list(await state.bridge.run(lambda: state.bridge.tokenize(text)))
    else:
        ids = [int(t) for t in prompt]
        _check_vocab(state, ids, "prompt")
    params = _sampling_params(body, body.max_tokens or 16, _stops(body), n)
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    return [_generate_request(rid, ids, body.model, params, bool(body.stream), _options(body))]


@router.post("/v1/messages/render", summary="The tokens an Anthropic message would prefill (vLLM shape)")
async def render_messages(
    body: MessagesRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    config = anthropic_tool_config(body)
    conversation, _ = to_messages(body)
    rendered = await render_prompt(state, config, conversation)
    ids = await _ids(state, rendered)
    stops = [*(body.stop_sequences or []), *rendered.stop]
    params = _sampling_params(body, body.max_tokens, stops)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    return _generate_request(rid, ids, body.model, params, bool(body.stream), None)


@router.post("/v1/responses/render", summary="The tokens a response would prefill (vLLM shape)")
async def render_response(
    body: ResponsesRequest, request: Request, tenant: Tenant = Depends(get_tenant)
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    refuse_unsupported(body)
    config = responses_tools(body)
    rendered = await render_prompt(state, config, responses_conversation(body.instructions, body.input))
    ids = await _ids(state, rendered)
    params = _sampling_params(body, body.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS, list(rendered.stop))
    rid = f"resp_{uuid.uuid4().hex[:24]}"
    return _generate_request(rid, ids, body.model, params, bool(body.stream), None)
