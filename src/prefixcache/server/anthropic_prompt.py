"""Anthropic request -> chat messages for the engine, and ``cache_control`` breakpoints -> a
TTL plan ``[(token_end, ttl_s), ...]`` over the rendered prompt's token positions.

A breakpoint marks the end of a content block (of the system prompt or of a message), or the
end of a whole message, or (top-level ``cache_control``) the end of the prompt. It gives every
full block up to it the breakpoint's TTL class; automatic caching of all full blocks applies as
well, so a breakpoint only ever lengthens a TTL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.policy import TTL_CLASSES
from prefixcache.server.errors import bad_request
from prefixcache.server.schemas_anthropic import ANTHROPIC_TTLS, MAX_BREAKPOINTS, CacheControl, _Prompt


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The end of ``content[:char_end]`` of message ``message_index`` (after the system message)."""

    message_index: int
    char_end: int
    ttl_s: float


def _ttl(cc: CacheControl) -> float:
    ttl = cc.ttl or "5m"
    if ttl not in ANTHROPIC_TTLS:  # the schema already refuses these; kept for library callers
        raise bad_request(f"cache_control.ttl must be one of {', '.join(ANTHROPIC_TTLS)}; got '{ttl}'.")
    return TTL_CLASSES[ttl]


def to_messages(req: _Prompt) -> tuple[list[dict[str, str]], list[Breakpoint]]:
    """The engine's chat messages (system first, text blocks joined) and the breakpoints."""
    messages: list[dict[str, str]] = []
    breakpoints: list[Breakpoint] = []
    system = req.system_blocks()
    if system:
        text = ""
        for block in system:
            text += block.text
            if block.cache_control is not None:
                breakpoints.append(Breakpoint(0, len(text), _ttl(block.cache_control)))
        messages.append({"role": "system", "content": text})
    for m in req.messages:
        idx = len(messages)
        text = ""
        for block in m.blocks():
            text += block.text
            if block.cache_control is not None:
                breakpoints.append(Breakpoint(idx, len(text), _ttl(block.cache_control)))
        if m.cache_control is not None:
            breakpoints.append(Breakpoint(idx, len(text), _ttl(m.cache_control)))
        messages.append({"role": m.role, "content": text})
    if req.cache_control is not None:
        last = len(messages) - 1
        breakpoints.append(Breakpoint(last, len(messages[last]["content"]), _ttl(req.cache_control)))
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise bad_request(
            f"A request may have at most {MAX_BREAKPOINTS} cache_control breakpoints; it has {len(breakpoints)}. "
            "Remove some (one breakpoint covers everything before it)."
        )
    if messages and messages[-1]["role"] == "system":
        raise bad_request("'messages' must not be empty: add a user message.", param="messages")
    return messages, breakpoints


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ttl_plan(
    messages: list[dict[str, Any]],
    breakpoints: list[Breakpoint],
    full_ids: Sequence[int],
    render_ids: Callable[[list[dict[str, Any]]], Sequence[int]],
) -> list[tuple[int, float]]:
    """Token position of each breakpoint: the common prefix of the full prompt's ids and the ids
    of the prompt cut at the breakpoint (the cut prompt's end-of-turn tokens differ from what
    follows in the full one). Token merges across the cut can only make a position smaller,
    so a breakpoint never covers tokens after it."""
    plan: list[tuple[int, float]] = []
    for bp in breakpoints:
        cut = [dict(m) for m in messages[: bp.message_index + 1]]
        cut[-1]["content"] = str(cut[-1]["content"])[: bp.char_end]
        end = len(full_ids) if cut == messages else common_prefix(full_ids, render_ids(cut))
        plan.append((end, bp.ttl_s))
    return plan
