"""KV events on the server: the publisher wired to the engine's cache, and the prompt's block
hashes told to a router that asks for them.

:func:`enable_kv_events` attaches a :class:`~prefixcache.kvevents.publisher.KVEventPublisher` to
the engine's cache (``prefixcache serve --kv-events-endpoint``), exports its counters on
``/metrics``, and installs :class:`PromptBlocks`.

Why a router needs the header: a replica's events name blocks by their keys, which are hashes of
token ids under the tenant's secret salt. prefixcache's router has neither the tokenizer nor the
salts, so it cannot compute a request's keys; instead, a request that carries
``x-prefixcache-want-blocks: 1`` gets back ``x-prefixcache-blocks: <prompt tokens> <block size>
<hash>,<hash>,...``: the wire hashes (16 hex digits, the ``int`` form) of its prompt's first full
blocks (at most :data:`MAX_BLOCKS`). They are the caller's own prompt's keys, which the caller
could not reverse into the salt. The router maps them onto its own routing chunks (see
:mod:`prefixcache.router.kv_index`). A streamed response carries the header too: it is computed
before the response starts.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from prefixcache.engine.types import GenerationSpec
from prefixcache.kvevents.publisher import KVEventPublisher
from prefixcache.kvevents.wire import HashFormat, external_hash, hash_as_int

log = logging.getLogger(__name__)

WANT_HEADER = "x-prefixcache-want-blocks"
BLOCKS_HEADER = "x-prefixcache-blocks"
#: Blocks listed at most (4,096 tokens at block size 16; about 4.3 KB of header).
MAX_BLOCKS = 256

#: The current request's slot for the header, set by :class:`PromptBlocks` when asked for.
_slot: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("prompt_blocks", default=None)


class PromptBlocks:
    """ASGI middleware: for a request asking for its blocks, open a slot that
    :func:`note_prompt_blocks` fills, and send what it holds as a response header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not any(
            k == WANT_HEADER.encode() and v.strip() == b"1" for k, v in scope.get("headers", [])
        ):
            await self.app(scope, receive, send)
            return
        slot: dict[str, str] = {}
        token = _slot.set(slot)

        async def send_with_blocks(message: Any) -> None:
            if message["type"] == "http.response.start" and "value" in slot:
                headers = [*message.get("headers", []), (BLOCKS_HEADER.encode(), slot["value"].encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_blocks)
        finally:
            _slot.reset(token)


def blocks_header(prompt_tokens: int, block_size: int, keys: list[bytes]) -> str:
    hashes = ",".join(f"{hash_as_int(external_hash(k, HashFormat.INT)):016x}" for k in keys[:MAX_BLOCKS])
    return f"{prompt_tokens} {block_size} {hashes}"


async def note_prompt_blocks(bridge: Any, spec: GenerationSpec) -> GenerationSpec:
    """Fill the current request's slot (if it asked) with its prompt's block hashes: the same
    ids and namespace the engine will use for ``spec``. Returns the spec to run: with the
    prompt's token ids when they were tokenized here (so the engine does not tokenize the
    prompt a second time); ``spec`` itself when it carries its ids or nothing was asked."""
    slot = _slot.get()
    cache = bridge.cache
    if slot is None or "value" in slot or cache is None:
        return spec
    if (spec.messages is None) + (spec.prompt is None) + (spec.prompt_token_ids is None) != 2:
        return spec  # not exactly one prompt: the engine refuses it

    def compute() -> tuple[str, list[int]]:
        if spec.prompt_token_ids is not None:
            ids = [int(t) for t in spec.prompt_token_ids]
        elif spec.prompt is not None:
            ids = bridge.tokenize(spec.prompt)
        else:
            ids = bridge.render_ids(list(spec.messages or []))
        ns = bridge.namespace(spec.tenant, spec.salt)
        limit = MAX_BLOCKS * cache.block_size
        return blocks_header(len(ids), cache.block_size, cache.block_keys(ids[:limit], ns)), ids

    try:
        slot["value"], ids = await bridge.run(compute)
    except Exception:  # the engine reports a bad prompt itself; the header is only a hint
        log.debug("no block hashes for this prompt", exc_info=True)
        return spec
    return spec if spec.prompt_token_ids is not None else spec.with_prompt_ids(ids)


def enable_kv_events(app: Any, publisher: KVEventPublisher) -> None:
    """Publish ``app``'s engine cache's events through ``publisher`` (attached now: call before
    traffic), count them on ``/metrics``, and answer routers' block-hash requests. The caller
    closes the publisher after the server stops."""
    state = app.state.prefixcache
    cache = state.bridge.cache
    if cache is None:
        raise ValueError("KV events need the prompt cache; it is disabled on this engine")
    publisher.attach(cache)

    class _Collector:
        def collect(self) -> list[Any]:
            return publisher.metrics()

    state.metrics.registry.register(_Collector())
    app.state.kv_events = publisher
    app.add_middleware(PromptBlocks)
