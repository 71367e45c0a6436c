"""The server's one door into the engine: admission (bounded queue), blocking calls moved off the
event loop, streaming with cancellation, and the engine's results and errors normalised.

Everything the server assumes about :class:`prefixcache.engine.Engine` is in this module, so an
engine API change is fixed here and nowhere else. Generation goes through the engine's choices
API (``generate_choices``, ``stream_choices``: ``n`` choices, logprobs, the prompt's usage as
soon as it is prefilled); :meth:`EngineBridge.stream` is its text-only view.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from prefixcache.cache.stats import Usage
from prefixcache.engine.serving.detok import TokenText
from prefixcache.engine.types import (
    ChoiceDelta,
    Completion,
    GenerationSpec,
    PromptDone,
    PromptTooLongError,
    QueueFullError,
    TokenLogprob,
)
from prefixcache.server.compat.kv_blocks import note_prompt_blocks
from prefixcache.server.errors import APIError, template_refusal
from prefixcache.server.tools.prompt import PromptRenderer, RenderedPrompt, ToolConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FinishedChoice:
    """One choice of a finished generation (``logprobs``: one entry per token, when asked)."""

    index: int
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Finished:
    """A generation's end: text, why it stopped, usage, time to first token, cache outcome.

    ``text``, ``finish_reason`` and ``stop_sequence`` are choice 0's; ``choices`` holds all
    ``n`` of them. ``usage`` counts the prompt once and sums the choices' generated tokens."""

    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    usage: Usage
    ttft_s: float | None
    outcome: str  # "hit" | "partial" | "miss"
    prompt_token_ids: list[int] = field(default_factory=list)
    stop_sequence: str | None = None
    choices: list[FinishedChoice] = field(default_factory=list)


def queue_full_error() -> APIError:
    return APIError(
        429,
        "The server is at capacity (request queue full); retry after a short wait.",
        code="queue_full",
        anthropic_status=529,
        headers={"retry-after": "1"},
    )


def tenant_queue_full_error(tenant: str, limit: int) -> APIError:
    """The caller's tenant holds its whole share of the queue: its own limit (429 on both APIs,
    ``rate_limit_error``), not the server's overload (529)."""
    return APIError(
        429,
        f"Tenant '{tenant[:100]}' already has {limit} requests in flight, its share of this server's "
        "queue (--tenant-queue-share); retry when one of them has finished.",
        code="tenant_queue_full",
        headers={"retry-after": "1"},
    )


def translate_error(exc: BaseException) -> APIError | None:
    """An engine exception as the APIError a client should see, or None for a real bug."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return queue_full_error()
    if isinstance(exc, PromptTooLongError):  # OpenAI's code for it, which clients look for
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ValueError):  # the engine's bad-input errors subclass ValueError
        return APIError(400, str(exc) or type(exc).__name__, code=type(exc).__name__)
    return template_refusal(exc)


def normalize(result: Completion) -> Finished:
    """The engine's :class:`Completion` as a :class:`Finished`."""
    choices = [
        FinishedChoice(
            c.index, c.text, "length" if c.finish_reason == "length" else "stop", c.stop_sequence, c.logprobs
        )
        for c in result.choices
    ]
    first = result.choices[0]
    return Finished(
        text=first.text,
        finish_reason=choices[0].finish_reason,
        usage=result.usage,
        ttft_s=first.ttft_s,
        outcome=first.outcome,
        prompt_token_ids=list(first.prompt_token_ids),
        stop_sequence=first.stop_sequence,
        choices=choices,
    )


def client_gone() -> APIError:
    """The client closed the connection before the answer (nginx's 499; nobody reads it)."""
    return APIError(499, "The client closed the request before the answer was ready.", code="client_closed")


async def _watch(
    disconnected: Callable[[], Awaitable[bool]], cancel: threading.Event, every_s: float = 0.1
) -> None:
    """Set ``cancel`` once the client has gone (polled: Starlette has no disconnect callback)."""
    while not cancel.is_set():
        if await disconnected():
            cancel.set()
            return
        await asyncio.sleep(every_s)


class Admission:
    """Counts generation requests in flight (running or waiting); refuses beyond ``max_queue``,
    and a tenant beyond ``tenant_limit`` of them (None: no per-tenant limit), so that one tenant
    flooding the server cannot take every slot from the others."""

    def __init__(self, max_queue: int, tenant_limit: int | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1; got {max_queue}")
        if tenant_limit is not None and tenant_limit < 1:
            raise ValueError(f"tenant_limit must be >= 1 or None; got {tenant_limit}")
        self.max_queue = max_queue
        self.tenant_limit = tenant_limit
        self._lock = threading.Lock()
        self._in_flight = 0
        self._by_tenant: dict[str, int] = {}  # tenants with requests in flight only

    @staticmethod
    def tenant_limit_for(max_queue: int, share: float, tenants: int) -> int | None:
        """The slots one tenant may hold: ``share`` of ``max_queue`` (at least one); None when
        there is one tenant (nobody to be fair to) or ``share`` is 1."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"the tenant queue share must be in (0, 1]; got {share}")
        if tenants < 2 or share == 1.0:
            return None
        return max(1, int(share * max_queue))

    @property
    def depth(self) -> int:
        return self._in_flight

    def tenant_depth(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def enter(self, tenant: str = "default") -> Callable[[], None]:
        """Take a slot or raise the 429/529 APIError at once (the tenant's share first: a tenant
        at its limit gets its own 429 even when the queue is full). Returns the (idempotent)
        release."""
        with self._lock:
            held = self._by_tenant.get(tenant, 0)
            if self.tenant_limit is not None and held >= self.tenant_limit:
                raise tenant_queue_full_error(tenant, self.tenant_limit)
            if self._in_flight >= self.max_queue:
                raise queue_full_error()
            self._in_flight += 1
            self._by_tenant[tenant] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._in_flight -= 1
                    left = self._by_tenant[tenant] - 1
                    if left:
                        self._by_tenant[tenant] = left
                    else:
                        del self._by_tenant[tenant]

        return release


class EngineBridge:
    """Calls into a blocking engine from async routes."""

    def __init__(self, engine: Any, max_queue: int, tenant_limit: int | None = None) -> None:
        self.engine = engine
        self.admission = Admission(max_queue, tenant_limit)
        self._streams: set[threading.Thread] = set()

    # ------------------------------------------------------------------ generation
    async def generate(
        self, spec: GenerationSpec, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> Finished:
        """One whole generation in a worker thread, under admission. With ``disconnected`` (the
        request's ``is_disconnected``), a client that goes away cancels the generation."""
        spec = await note_prompt_blocks(self, spec)  # (a router asked for the prompt's block hashes)
        release = self.admission.enter(spec.tenant)
        cancel = threading.Event()
        kwargs = spec.engine_kwargs()
        watcher: asyncio.Task[None] | None = None
        if disconnected is not None:
            kwargs["cancel"] = cancel
            watcher = asyncio.create_task(_watch(disconnected, cancel))
        try:
            result = await anyio.to_thread.run_sync(lambda: self.engine.generate_choices(**kwargs))
        except Exception as exc:
            if cancel.is_set():
                raise client_gone() from exc
            api = translate_error(exc)
            if api is None:
                raise
            raise api from exc
        finally:
            if watcher is not None:
                watcher.cancel()
            release()
        return normalize(result)

    async def stream_choices(
        self, spec: GenerationSpec, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[PromptDone | ChoiceDelta | Finished]:
        """One :class:`PromptDone` (the prompt is prefilled: its cache usage is final), the
        choices' :class:`ChoiceDelta` items, then one :class:`Finished`. Admission is taken
        before the first item, so a full queue raises before any byte is sent. When the
        consumer stops early (a client disconnect cancels it), the engine's generator is closed
        in its own thread, which makes the engine release the request's block references.

        ``disconnected`` (the request's ``is_disconnected``) is watched until the first item:
        a client that leaves while its request waits in the queue cancels it there, before any
        forward pass, and this raises the 499 :class:`APIError`. From the first item on the
        response is streaming and the HTTP layer sees a disconnect (it stops the consumer)."""
        spec = await note_prompt_blocks(self, spec)
        release = self.admission.enter(spec.tenant)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def post(kind: str, value: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (server shutting down)
                loop.call_soon_threadsafe(items.put_nowait, (kind, value))

        # The engine's worker checks it at every step: a disconnect stops the generation at
        # once, even while this thread waits for the next delta.
        kwargs = {**spec.engine_kwargs(), "cancel": cancel}

        def drive() -> None:
            gen: Iterator[Any] | None = None
            try:
                gen = iter(self.engine.stream_choices(**kwargs))
                for item in gen:
                    if cancel.is_set():
                        break
                    post("item", item)
            except BaseException as exc:  # handed to the consumer, which decides
                post("error", exc)
            finally:
                try:
                    close = getattr(gen, "close", None)
                    if close is not None:
                        close()  # GeneratorExit inside the engine: its finally releases the blocks
                finally:
                    release()
                    self._streams.discard(threading.current_thread())
                    post("done", None)

        thread = threading.Thread(target=drive, name="prefixcache-stream", daemon=True)
        self._streams.add(thread)
        try:
            thread.start()
        except BaseException:
            self._streams.discard(thread)
            release()
            raise
        watcher = asyncio.create_task(_watch(disconnected, cancel)) if disconnected is not None else None
        try:
            while True:
                kind, value = await items.get()
                if watcher is not None:  # the first item: from here the response streams
                    watcher.cancel()
                    watcher = None
                    if cancel.is_set() and kind != "item":  # left while queued: dropped unprefilled
                        raise client_gone()
                if kind == "done":
                    return
                if kind == "error":
                    api = translate_error(value)
                    if api is None:
                        raise value
                    raise api
                yield normalize(value) if isinstance(value, Completion) else value
        finally:
            if watcher is not None:
                watcher.cancel()
            cancel.set()

    def active_streams(self) -> int:
        """Stream threads still running (tests wait for 0 after a disconnect)."""
        return len(self._streams)

    # ------------------------------------------------------------------ prompts and cache
    async def run(self, fn: Callable[[], Any]) -> Any:
        """A blocking engine call (tokenize, pin, stats) in a worker thread, errors translated."""
        try:
            return await anyio.to_thread.run_sync(fn)
        except Exception as exc:
            api = translate_error(exc)
            if api is None:
                raise
            raise api from exc

    # ------------------------------------------------------------------ engine specifics
    def render_ids(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the prompt the engine builds from these chat messages."""
        return list(self.engine.render_ids(messages, add_generation_prompt=add_generation_prompt))

    def renderer(self, tools: ToolConfig) -> PromptRenderer:
        """A prompt renderer for this engine's model under one request's tools."""
        engine = self.engine
        return PromptRenderer(
            tools, engine.tokenizer, lambda messages, gen: engine.render(messages, add_generation_prompt=gen)
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of prompt text (special-token strings become specials), as the engine prefills."""
        return list(self.engine.tokenize(text))

    def prompt_ids(self, rendered: RenderedPrompt) -> list[int]:
        """The token ids the engine prefills for ``rendered`` (``generation.with_prompt``'s spec)."""
        if rendered.text is not None:
            return self.tokenize(rendered.text + rendered.assistant_prefix)
        return self.render_ids(rendered.messages or [])

    @property
    def max_n(self) -> int:
        """The most choices (``n``) one request may ask for."""
        return int(self.engine.max_n)

    @functools.cached_property
    def token_text(self) -> TokenText:
        """Each token's bytes and printable text (logprobs)."""
        return TokenText(self.engine.tokenizer)

    def decode(self, ids: list[int]) -> str:
        """The text of prompt token ids (``echo`` of a token-id prompt)."""
        return str(self.engine.tokenizer.decode(ids, skip_special_tokens=False))

    @property
    def block_size(self) -> int:
        cache = self.cache
        return int(cache.block_size) if cache is not None else 16

    @property
    def cache(self) -> Any | None:
        return getattr(self.engine, "cache", None)

    @property
    def enabled_cache(self) -> Any:
        """The engine's cache; a 400 (``cache_disabled``) when the server runs without one."""
        cache = self.cache
        if cache is None:
            raise APIError(400, "The prompt cache is disabled on this server.", code="cache_disabled")
        return cache

    def namespace(self, tenant: str, salt: bytes) -> Any:
        """The cache namespace of this tenant's requests (same as the engine's)."""
        return self.enabled_cache.namespace(self.engine.fingerprint, tenant=tenant, salt=salt)
