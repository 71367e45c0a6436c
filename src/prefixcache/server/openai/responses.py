"""POST /v1/responses: the OpenAI Responses API over the chat route's path (the same prompt
rendering, tenants, ``prompt_cache_key`` / ``prompt_cache_retention`` and usage).

A response's ``output`` is a ``message`` item (its text, as one ``output_text`` part; omitted
when the reply is only calls) followed by one ``function_call`` item per call. ``status`` is
``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) when the output hit
``max_output_tokens`` without a call. Usage: ``input_tokens``,
``input_tokens_details.cached_tokens`` (read from the cache) and ``.cache_write_tokens``,
``output_tokens``, ``total_tokens``.

Streaming sends the hosted event types, each with a ``sequence_number``: ``response.created``,
``response.in_progress``; for the text ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``).

Nothing is stored: ``store: true``, ``previous_response_id``, ``conversation`` and the other
fields of :func:`refuse_unsupported` answer a 400 that names the field.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prefixcache.engine.types import ChoiceDelta, GenerationSpec, PromptDone
from prefixcache.server.auth import Tenant
from prefixcache.server.bridge import Finished, Usage
from prefixcache.server.errors import APIError, bad_request
from prefixcache.server.generation import SSE_HEADERS, Generation, sse_event, with_prompt
from prefixcache.server.limits import CheckedRoute
from prefixcache.server.openai.prompt import responses_conversation, responses_tool_config
from prefixcache.server.openai.routes import DEFAULT_CHAT_MAX_TOKENS, generation_spec, render_prompt
from prefixcache.server.openai.schemas_responses import ResponsesRequest
from prefixcache.server.openai.structured import compile_grammar, forced_tool_grammar, responses_grammar
from prefixcache.server.ops.cache_reasons import prefixcache_field
from prefixcache.server.state import get_state, get_tenant
from prefixcache.server.tools.calls import ParsedCall, ParsedReply, new_call_id
from prefixcache.server.tools.output import CallsFound, parse_reply, split_stream, with_ids

router = APIRouter(route_class=CheckedRoute)

#: ``include`` values that ask for nothing this server could produce (there is no reasoning).
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400 naming the first field set to something this server cannot honour."""
    refusals = [
        (
            body.store is True,
            "store",
            "'store': true is not supported: this server keeps no responses; "
            "send 'store': false (or omit it) and resend the conversation in 'input'.",
        ),
        (
            body.previous_response_id is not None,
            "previous_response_id",
            "'previous_response_id' is not "
            "supported: this server keeps no responses; resend the conversation in 'input'.",
        ),
        (
            body.conversation is not None,
            "conversation",
            "'conversation' is not supported: this server keeps no "
            "conversations; resend the conversation in 'input'.",
        ),
        (
            body.background is True,
            "background",
            "'background': true is not supported: send the request without it (stream it to see progress).",
        ),
        (
            body.prompt is not None,
            "prompt",
            "'prompt' (a stored prompt template) is not supported: send the "
            "text in 'instructions' and 'input'.",
        ),
        (
            body.prompt_cache_options is not None,
            "prompt_cache_options",
            "'prompt_cache_options' is not supported: use 'prompt_cache_retention' ('in_memory' or '24h').",
        ),
        (
            _set(body.reasoning),
            "reasoning",
            "'reasoning' is not supported: this model does not reason; remove it.",
        ),
        (
            not _plain_text(body.text) and responses_grammar(body.text) is None,
            "text",
            "'text' may ask for plain text or a format of type 'json_object' or 'json_schema'; "
            "'verbosity' other than 'medium' is not supported.",
        ),
        (
            bool(set(body.include or ()) - HARMLESS_INCLUDES),
            "include",
            "'include' values other than 'reasoning.encrypted_content' are not supported: remove them.",
        ),
        (
            bool(body.top_logprobs),
            "top_logprobs",
            "'top_logprobs' is not supported on /v1/responses: remove it.",
        ),
        (
            body.truncation == "auto",
            "truncation",
            "'truncation': 'auto' is not supported: a prompt over the "
            "context is refused; send 'disabled' and a shorter input.",
        ),
    ]
    for refused, param, message in refusals:
        if refused:
            raise bad_request(message, param=param)


def _set(value: Any) -> bool:
    """Whether an object field asks for something (``{"effort": null}`` asks for nothing)."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return value is not None


def _plain_text(text: Any) -> bool:
    if text is None:
        return True
    if not isinstance(text, dict):
        return False
    fmt = text.get("format")
    return (fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")) and text.get(
        "verbosity"
    ) in (None, "medium")


def _format_echo(text: Any) -> Any:
    """The response's ``text.format``: the request's (structured output), or plain text."""
    fmt = text.get("format") if isinstance(text, dict) else None
    structured = isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")
    return fmt if structured else {"type": "text"}


def responses_usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens,
        },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def function_call_item(
    item_id: str, call_id: str, call: ParsedCall, arguments: str | None = None
) -> dict[str, Any]:
    """A ``function_call`` output item (``arguments`` "": the stream's empty start)."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


class ResponseShell:
    """The response object of one request, without its output until it is done."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        spec: GenerationSpec,
        parallel: bool,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.decode = decode
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.created_at = int(time.time())
        self.base: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": model,
            "output": [],
            "parallel_tool_calls": parallel,
            "previous_response_id": None,
            "prompt_cache_key": body.prompt_cache_key,
            "prompt_cache_retention": body.prompt_cache_retention,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": spec.temperature,
            "text": {"format": _format_echo(body.text)},
            "tool_choice": _tool_choice_echo(body),
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": spec.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def pending(self) -> dict[str, Any]:
        return dict(self.base)

    def done(self, fin: Finished, output: list[dict[str, Any]], called: bool) -> dict[str, Any]:
        incomplete = fin.finish_reason == "length" and not called
        return {
            **self.base,
            "status": "incomplete" if incomplete else "completed",
            "completed_at": None if incomplete else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "usage": responses_usage(fin.usage),
            **prefixcache_field(fin.usage, self.decode),
        }


def _tool_choice_echo(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def output_items(reply: ParsedReply, incomplete: bool) -> list[dict[str, Any]]:
    items = []
    if reply.text or not reply.calls:
        items.append(
            message_item(new_call_id("msg_"), reply.text, "incomplete" if incomplete else "completed")
        )
    items.extend(
        function_call_item(new_call_id("fc_"), call_id, c) for call_id, c in with_ids(reply.calls, "call_")
    )
    return items


@router.post("/v1/responses", summary="Create a model response (OpenAI Responses shape)")
async def create_response(
    body: ResponsesRequest, request: Request, tenant: Annotated[Tenant, Depends(get_tenant)]
) -> Any:
    state = get_state(request)
    state.check_model(body.model)
    refuse_unsupported(body)
    config = responses_tool_config(body)
    rendered = await render_prompt(state, config, responses_conversation(body.instructions, body.input))
    spec = replace(
        with_prompt(generation_spec(body, tenant), rendered, None),
        max_tokens=body.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
    )
    ask = responses_grammar(body.text)
    if ask is not None and config.parses_calls:
        raise bad_request(
            "'text.format' with 'tools' is not supported: send 'tool_choice': 'none' or drop one of them.",
            param="text.format",
        )
    grammar = await compile_grammar(state.bridge, ask or forced_tool_grammar(config))
    if grammar is not None:
        spec = replace(spec, grammar=grammar)
    shell = ResponseShell(body, state.model_name, spec, config.parallel, state.bridge.decode)
    gen = Generation(request, tenant, spec, rendered.trace_text(), body.prompt_cache_key)
    if not body.stream:
        fin = await gen.run()
        reply = parse_reply(fin.text, rendered, config)
        incomplete = fin.finish_reason == "length" and not reply.calls
        return JSONResponse(shell.done(fin, output_items(reply, incomplete), bool(reply.calls)))
    items = await gen.open_stream()
    events = ResponseEvents(shell)

    async def stream() -> AsyncIterator[str]:
        yield events.emit("response.created", response=shell.pending())
        yield events.emit("response.in_progress", response=shell.pending())
        async for item in split_stream(items, rendered, config, "call_"):
            if isinstance(item, APIError):
                yield events.emit("error", code=item.code, message=item.message, param=item.param)
                return
            if isinstance(item, PromptDone):
                continue  # the prompt is prefilled; response.created went out already
            if isinstance(item, ChoiceDelta):  # the one choice: text (calls are taken out)
                if item.text:
                    for event in events.text(item.text):
                        yield event
            elif isinstance(item, CallsFound):
                for event in events.calls(item):
                    yield event
            else:  # the Finished (recorded as it passed)
                for event in events.finish(item):
                    yield event

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


class ResponseEvents:
    """The SSE events of one streamed response, numbered in order; keeps the output items sent
    so that ``response.completed`` carries the same items (ids included)."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.message_id: str | None = None  # the open message item
        self.text_so_far = ""
        self.called = False

    def emit(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(kind, data)

    def text(self, delta: str) -> list[str]:
        events = [] if self.message_id is not None else self._open_message()
        self.text_so_far += delta
        where = {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}
        events.append(self.emit("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return events

    def _open_message(self) -> list[str]:
        self.message_id = new_call_id("msg_")
        item = {**message_item(self.message_id, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}
        return [
            self.emit("response.output_item.added", output_index=len(self.output), item=item),
            self.emit("response.content_part.added", **where, part=part),
        ]

    def _close_message(self, status: str) -> list[str]:
        if self.message_id is None:
            return []
        item = message_item(self.message_id, self.text_so_far, status)
        where = {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}
        events = [
            self.emit("response.output_text.done", **where, text=self.text_so_far, logprobs=[]),
            self.emit("response.content_part.done", **where, part=item["content"][0]),
            self.emit("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.message_id = None
        return events

    def calls(self, found: CallsFound) -> list[str]:
        events = self._close_message("completed")
        for call_id, call in found.calls:
            item_id, index = new_call_id("fc_"), len(self.output)
            events.append(
                self.emit(
                    "response.output_item.added",
                    output_index=index,
                    item=function_call_item(item_id, call_id, call, arguments=""),
                )
            )
            events.append(
                self.emit(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=call.arguments,
                )
            )
            events.append(
                self.emit(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            item = function_call_item(item_id, call_id, call)
            events.append(self.emit("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        self.called = True
        return events

    def finish(self, fin: Finished) -> list[str]:
        events: list[str] = []
        incomplete = fin.finish_reason == "length" and not self.called
        if not self.called and self.message_id is None:
            events.extend(self._open_message())  # an empty reply is still one (empty) message
        events.extend(self._close_message("incomplete" if incomplete else "completed"))
        response = self.shell.done(fin, self.output, self.called)
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self.emit(kind, response=response))
        return events
