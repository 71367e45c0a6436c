"""What the router knows about a request's prefix, without a tokenizer.

The router cannot compute the replicas' block keys (it has no tokenizer and no tenant salt), so
it works on text (with the key functions of :mod:`prefixcache.routing`, which the simulator
uses on token blocks): the request is rendered to a canonical string (tenant credential, model,
tools, system, then each message's role and text, in order), cut into ``chunk_chars`` pieces, and
hashed in a chain like the block keys: ``h[i] = sha256(h[i-1] || chunk i)``. Two requests share
``h[i]`` exactly when they share the first ``(i+1) * chunk_chars`` characters of that rendering,
which for chat traffic tracks a shared token prefix closely. The credential is hashed in first:
tenants never share cache entries, so routing them together would gain nothing.

``prompt_cache_key`` (OpenAI) or ``metadata.prompt_cache_key`` overrides: it names the affinity
group explicitly and becomes the first chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixcache.content import content_text
from prefixcache.routing import affinity_index, chain_root, chunk_chain, explicit_affinity


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """The routing view of one request.

    ``chunks``: chained chunk hashes of the rendered prompt, at most ``max_chunks`` (hex, short).
    ``affinity``: the key the prefix-affinity policy hashes (the chunk at ``affinity_chars``, or
    the explicit ``prompt_cache_key``). ``explicit``: a client-given key was used.
    """

    affinity: str
    chunks: tuple[str, ...]
    explicit: bool = False


def render_prompt(body: dict[str, Any], limit: int) -> str:
    """A canonical rendering of the leading part of a chat or completion request (<= limit chars)."""
    out: list[str] = []
    size = 0

    def add(s: str) -> bool:
        nonlocal size
        out.append(s)
        size += len(s)
        return size >= limit

    if add(f"model={body.get('model', '')}\n"):
        return "".join(out)[:limit]
    if body.get("tools") and add(
        "tools=" + json.dumps(body["tools"], sort_keys=True, separators=(",", ":")) + "\n"
    ):
        return "".join(out)[:limit]
    system = body.get("system")  # Anthropic
    if system is not None and add("system:" + content_text(system, routing_key=True) + "\n"):
        return "".join(out)[:limit]
    instructions = body.get("instructions")  # OpenAI Responses
    if isinstance(instructions, str) and add("system:" + instructions + "\n"):
        return "".join(out)[:limit]
    if "input" in body:  # OpenAI Responses: a string, or message and function-call items
        items = body["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and "role" in item:
                line = f"{item.get('role', '')}:" + content_text(item.get("content"), routing_key=True)
            else:
                line = json.dumps(item, sort_keys=True, separators=(",", ":"))
            if add(line + "\n"):
                break
        return "".join(out)[:limit]
    if "prompt" in body:  # OpenAI completions
        prompt = body["prompt"]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        add("prompt:" + text)
        return "".join(out)[:limit]
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else []:
        if not isinstance(msg, dict):
            continue
        if add(f"{msg.get('role', '')}:" + content_text(msg.get("content"), routing_key=True) + "\n"):
            break
    return "".join(out)[:limit]


def prefix_key(
    body: dict[str, Any],
    credential: str = "",
    *,
    chunk_chars: int = 256,
    max_chunks: int = 32,
    affinity_chars: int = 1024,
) -> PrefixKey:
    """Chained chunk hashes of ``body``'s rendering, and its affinity key. Never raises on odd
    bodies (a non-chat body renders to little more than its model name)."""
    explicit = body.get("prompt_cache_key")
    if explicit is None and isinstance(body.get("metadata"), dict):
        explicit = body["metadata"].get("prompt_cache_key")
    text = render_prompt(body, chunk_chars * max_chunks)
    root = chain_root(credential, None if explicit is None else str(explicit))
    n_full = max(len(text) // chunk_chars, 1)
    pieces = (text[i * chunk_chars : (i + 1) * chunk_chars].encode() for i in range(n_full))
    chunks = chunk_chain(root, pieces)
    if explicit is not None:
        affinity = explicit_affinity(credential, str(explicit))
        return PrefixKey(affinity=affinity, chunks=tuple(chunks), explicit=True)
    idx = affinity_index(len(chunks), affinity_chars // chunk_chars)
    return PrefixKey(affinity=chunks[idx], chunks=tuple(chunks), explicit=False)
