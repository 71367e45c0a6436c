"""A generation's reply with its tool calls, in each API's shape.

    reply = parse_reply(choice.text, rendered, config)          # whole answers, per choice
    async for item in split_stream(items, rendered, config):    # streams (see below)
        ...

Without tools (or with ``tool_choice`` none) the reply is the generated text unchanged and a
stream passes through untouched. With tools, the parser of :mod:`tool_calls` sees the forced
reply start (``rendered.assistant_prefix``) followed by the generated text. A stream is the
bridge's choices items (:class:`PromptDone`, :class:`ChoiceDelta`, :class:`Finished`,
:class:`APIError`); each choice's text goes through its own splitter: text is sent (as a
``ChoiceDelta`` of that choice) as soon as it cannot belong to a call, and when the choice ends
its calls come as one :class:`CallsFound` item just before the ``ChoiceDelta`` that carries its
``finish_reason``. The routes refuse ``logprobs`` when calls are parsed, so the split deltas
carry none.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prefixcache.engine.types import ChoiceDelta, PromptDone
from prefixcache.server.bridge import Finished
from prefixcache.server.errors import APIError
from prefixcache.server.tools.calls import (
    ParsedCall,
    ParsedReply,
    ToolCallSplitter,
    new_call_id,
    parse_tool_calls,
)
from prefixcache.server.tools.prompt import RenderedPrompt, ToolConfig


@dataclass(slots=True)
class CallsFound:
    """The calls of a streamed choice (``index``), each with the id the API reports it under."""

    calls: list[tuple[str, ParsedCall]]
    index: int = 0


def parse_reply(text: str, rendered: RenderedPrompt, config: ToolConfig) -> ParsedReply:
    if not config.parses_calls:
        return ParsedReply(text)
    return parse_tool_calls(rendered.assistant_prefix + text, config.names(), rendered.syntax)


def with_ids(calls: list[ParsedCall], id_prefix: str) -> list[tuple[str, ParsedCall]]:
    """New ids: ``call_`` (OpenAI) or ``toolu_`` (Anthropic)."""
    return [(new_call_id(id_prefix), c) for c in calls]


async def split_stream(
    items: AsyncIterator[PromptDone | ChoiceDelta | Finished | APIError],
    rendered: RenderedPrompt,
    config: ToolConfig,
    id_prefix: str,
) -> AsyncIterator[PromptDone | ChoiceDelta | CallsFound | Finished | APIError]:
    """The stream's items with tool calls taken out of each choice's text (see the module doc)."""
    if not config.parses_calls:
        async for item in items:
            yield item
        return
    splitters: dict[int, ToolCallSplitter] = {}
    async for item in items:
        if not isinstance(item, ChoiceDelta):
            yield item
            continue
        splitter = splitters.get(item.index)
        if splitter is None:
            splitter = ToolCallSplitter(config.names(), rendered.syntax, rendered.assistant_prefix)
            splitters[item.index] = splitter
        safe = splitter.push(item.text) if item.text else ""
        if item.finish_reason is None:
            if safe:
                yield ChoiceDelta(item.index, safe)
            continue
        reply = splitter.finish()
        rest = safe + reply.text[splitter.sent :]
        if rest:
            yield ChoiceDelta(item.index, rest)
        if reply.calls:
            yield CallsFound(with_ids(reply.calls, id_prefix), item.index)
        yield ChoiceDelta(item.index, "", finish_reason=item.finish_reason)


# ---------------------------------------------------------------------------- OpenAI chat


def openai_tool_call(call_id: str, call: ParsedCall) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def openai_message(reply: ParsedReply) -> dict[str, Any]:
    """A chat completion's ``message``: ``content`` null when the reply is only calls."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text, "refusal": None}
    if reply.calls:
        message["content"] = reply.text or None
        message["tool_calls"] = [openai_tool_call(i, c) for i, c in with_ids(reply.calls, "call_")]
    return message


def openai_call_deltas(found: CallsFound) -> list[dict[str, Any]]:
    """Chunk deltas of the calls: per call, its id and name, then its arguments."""
    deltas: list[dict[str, Any]] = []
    for index, (call_id, call) in enumerate(found.calls):
        head = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


# ---------------------------------------------------------------------------- Anthropic


def anthropic_tool_use(call_id: str, call: ParsedCall, *, with_input: bool = True) -> dict[str, Any]:
    """A ``tool_use`` content block (``with_input`` False: the stream's empty start)."""
    return {
        "type": "tool_use",
        "id": call_id,
        "name": call.name,
        "input": json.loads(call.arguments) if with_input else {},
    }


def anthropic_content(reply: ParsedReply) -> list[dict[str, Any]]:
    """A message's ``content``: the text (omitted when empty and there are calls), then the
    ``tool_use`` blocks."""
    blocks: list[dict[str, Any]] = []
    if reply.text or not reply.calls:
        blocks.append({"type": "text", "text": reply.text})
    blocks.extend(anthropic_tool_use(i, c) for i, c in with_ids(reply.calls, "toolu_"))
    return blocks
