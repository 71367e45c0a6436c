"""The text of a chat message's ``content``: the one reader the engine, the ops tools and the router share.

OpenAI and Anthropic send ``content`` as a string or as a list of parts (``{"type": "text",
"text": ...}``, images, tool calls, tool results). Two readers need its text, for different ends:

* the prompt a model sees (the default): the parts' text joined with nothing; a part without
  text (an image, a tool call) adds nothing, and a part that is not a dict adds ``str(part)``;
* a routing key (``routing_key=True``), which the router hashes and no model ever reads: every
  part counts, so that two requests differing only in an image never share a key. Text parts
  give their text, a ``tool_result`` its nested content (read the same way), anything else its
  canonical JSON; parts are joined by newlines.

This module imports nothing heavy (no torch, no transformers), so the router can use it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["content_text"]


def content_text(content: Any, upto_block: int | None = None, *, routing_key: bool = False) -> str:
    """``content`` (None, a string or a list of parts) as text; see the module docstring.

    ``upto_block``: only parts ``[0, upto_block]`` (the end of an Anthropic cache breakpoint).
    ``routing_key``: the router's rendering. Its output must never change for a given request:
    it feeds the routing keys that decide which replica holds a conversation's cache.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return _canonical_json(content) if routing_key else str(content)
    parts = content if upto_block is None else content[: upto_block + 1]
    if routing_key:
        return "\n".join(map(_routing_part, parts))
    return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in parts)


def _routing_part(part: Any) -> str:
    """One part of a content list as the routing key reads it."""
    if not isinstance(part, dict):
        return str(part)
    if "text" in part:
        return str(part["text"])
    if part.get("type") == "tool_result":
        return content_text(part.get("content"), routing_key=True)
    return _canonical_json(part)  # images, tool calls: their JSON is stable enough to key on


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
