"""The generation plumbing every API's route shares, so that a route is an adapter: its request
parsed and validated -> a :class:`~prefixcache.engine.types.GenerationSpec` -> :class:`Generation`
(:meth:`~Generation.run` for JSON, :meth:`~Generation.open_stream` for events) -> its JSON or its
events, framed by :func:`sse_data` / :func:`sse_event`.

:class:`Generation` calls the engine through :class:`~prefixcache.server.bridge.EngineBridge`
and records every finished generation (:func:`record`: metrics, dashboard, the busting watch,
the trace log, and the caller-text note that withholds another caller's prompt text from a miss
reason) before the route renders it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from prefixcache.engine.types import ChoiceDelta, GenerationSpec, PromptDone
from prefixcache.server.auth import Tenant
from prefixcache.server.bridge import Finished, translate_error
from prefixcache.server.errors import APIError
from prefixcache.server.state import ServerState, get_state
from prefixcache.server.tools.prompt import RenderedPrompt

log = logging.getLogger(__name__)

#: The headers of every event stream (no caching, no proxy buffering).
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
#: OpenAI's last event of a chat or completions stream.
SSE_DONE = "data: [DONE]\n\n"
#: The header naming the caller's endpoint in the trace log and the busting watch.
ENDPOINT_HEADER = "x-prefixcache-endpoint"

#: What a started stream yields: the engine's items, then a last APIError if it failed.
StreamItem = PromptDone | ChoiceDelta | Finished | APIError

#: The hosted APIs' sampling defaults (OpenAI's and Anthropic's alike): what a request that names
#: no ``temperature`` or ``top_p`` samples with here (the engine's own default is greedy).
API_TEMPERATURE = 1.0
API_TOP_P = 1.0


def api_sampling(temperature: float | None, top_p: float | None) -> tuple[float, float]:
    """A request's ``(temperature, top_p)``, the APIs' defaults where it names none."""
    return (
        API_TEMPERATURE if temperature is None else temperature,
        API_TOP_P if top_p is None else top_p,
    )


def _json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse_data(obj: dict[str, Any]) -> str:
    """One unnamed event (OpenAI's chat and completions chunks)."""
    return f"data: {_json(obj)}\n\n"


def sse_event(name: str, obj: dict[str, Any]) -> str:
    """One named event (Anthropic's messages, the Responses API)."""
    return f"event: {name}\ndata: {_json(obj)}\n\n"


def with_prompt(spec: GenerationSpec, rendered: RenderedPrompt, stop: list[str] | None) -> GenerationSpec:
    """``spec`` with the rendered prompt (``messages`` the engine renders, or ``prompt`` text)
    and the stop strings (the request's, then the tools')."""
    stops = [*(stop or []), *rendered.stop] or None
    if rendered.text is not None:
        return replace(spec, prompt=rendered.text + rendered.assistant_prefix, stop=stops)
    return replace(spec, messages=rendered.messages, stop=stops)


def trace_ttl_s(spec: GenerationSpec) -> float | None:
    """The TTL class the trace log notes: the spec's ``ttl_s``, else its plan's longest."""
    if spec.ttl_s is not None:
        return spec.ttl_s
    return max((ttl for _, ttl in spec.ttl_plan or ()), default=None)


def record(
    state: ServerState,
    request: Request,
    tenant: Tenant,
    fin: Finished,
    text: dict[str, Any] | None,
    ttl_s: float | None = None,
    cache_key: str | None = None,
) -> None:
    """Count a finished generation in the metrics and the trace log (``cache_key``: the
    request's ``prompt_cache_key``, kept for routing analysis). Call it before the answer
    is rendered: it also withholds the miss reason's text of another caller's prompt."""
    if state.caller_text is not None:
        state.caller_text.note(tenant, fin.prompt_token_ids, fin.usage)
    state.metrics.observe(fin.usage, fin.ttft_s, fin.outcome)
    u = fin.usage
    state.dashboard.note(
        tenant.name,
        tenant.salt,
        fin.prompt_token_ids,
        u.prompt_tokens,
        u.cached_tokens,
        u.cache_write_tokens,
        fin.ttft_s,
        fin.outcome,
        credential=tenant.credential,
    )
    if request.url.path.startswith("/v1/cache/"):
        return  # a pin's prefill: cache maintenance, not an endpoint's traffic (no trace line)
    endpoint = (request.headers.get(ENDPOINT_HEADER) or request.url.path)[:200]
    if state.busting is not None:
        state.busting.submit(tenant.name, endpoint, fin.prompt_token_ids)
    if state.trace is not None:
        state.trace.record(
            tenant=tenant.name,
            endpoint=endpoint,
            result=fin,
            text=text,
            ttl_s=ttl_s,
            cache_key=cache_key,
            salt=tenant.salt,
        )


@dataclass(frozen=True, slots=True)
class Generation:
    """One API request's generation: its spec and what its record needs (``text``: the
    ``--trace-text`` record of its prompt; ``cache_key``: its ``prompt_cache_key``)."""

    request: Request
    tenant: Tenant
    spec: GenerationSpec
    text: dict[str, Any] | None = None
    cache_key: str | None = None

    @property
    def state(self) -> ServerState:
        return get_state(self.request)

    def record(self, fin: Finished) -> None:
        record(self.state, self.request, self.tenant, fin, self.text, trace_ttl_s(self.spec), self.cache_key)

    async def run(self) -> Finished:
        """The whole generation, recorded (a client that leaves cancels it: 499)."""
        fin = await self.state.bridge.generate(self.spec, self.request.is_disconnected)
        self.record(fin)
        return fin

    async def open_stream(self) -> AsyncIterator[StreamItem]:
        """Open the engine stream (the bridge's :meth:`~EngineBridge.stream_choices` items:
        PromptDone, ChoiceDelta, Finished) and pull its first item, so a bad request or a full
        queue is still answered with a 4xx before the 200 and the first byte go out. A client
        that leaves while the request waits for the engine cancels it before its prefill (499).
        The items it returns record the :class:`Finished` as it passes."""
        agen = self.state.bridge.stream_choices(self.spec, self.request.is_disconnected)
        first: list[PromptDone | ChoiceDelta | Finished] = []
        try:
            first.append(await agen.__anext__())
        except StopAsyncIteration:
            pass
        except BaseException:
            await agen.aclose()  # type: ignore[attr-defined]
            raise
        return self._items(agen, first)

    async def _items(
        self, agen: AsyncIterator[PromptDone | ChoiceDelta | Finished], first: list[Any]
    ) -> AsyncIterator[StreamItem]:
        """The stream's items; a failure after the 200 went out becomes a last :class:`APIError`
        item, which the route sends as an error event (the status can no longer change)."""
        pending = list(first)
        while True:
            if pending:
                item = pending.pop(0)
            else:
                try:
                    item = await anext(agen)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    api = translate_error(exc)
                    if api is None:
                        log.exception("a stream failed after it started")
                        api = APIError(
                            500, f"The generation failed ({type(exc).__name__}); see the server log."
                        )
                    yield api
                    return
            if isinstance(item, Finished):
                self.record(item)
            elif isinstance(item, PromptDone) and self.state.caller_text is not None:
                self.state.caller_text.screen(self.tenant, item.prompt_token_ids, item.usage)
            yield item
