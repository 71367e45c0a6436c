"""Helpers of the server tests: a live uvicorn server in a thread, an engine gate, waits."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

from prefixcache.commands.redis_process import free_port
from prefixcache.engine.types import ChoiceDelta, Completion, PromptDone, Usage


class RunningServer:
    def __init__(self, app: Any, engine: Any) -> None:
        self.app = app
        self.engine = engine
        self.port = free_port()  # below the ephemeral range: no other socket takes it first
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def state(self) -> Any:
        return self.app.state.prefixcache

    def start(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the server on {self.url} did not answer /health within 60 s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (no timing assertion: the timeout only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Gated:
    """Wraps an engine so a test holds it at known points, deterministically. It wraps the
    engine's choices API, which the server's bridge calls.

    ``generate_choices`` sets ``entered`` and waits for ``release`` before it calls the engine;
    with ``hold_generate``, the engine then waits at its first cancel poll (``held`` is set)
    until ``resume`` is set or the server cancels the request.
    ``stream_choices`` lets the engine run until the consumer has taken its first text delta;
    from then on, every step the engine's worker takes (it polls its ``cancel`` signal once per
    decode step) waits until ``resume`` is set or the server cancels the request. ``steps``
    counts the held steps: after a disconnect it stays small however large ``max_tokens`` is.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.entered = threading.Event()
        self.release = threading.Event()
        self.resume = threading.Event()
        self.first_taken = threading.Event()
        self.steps = 0
        self.hold_generate = False
        self.held = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate_choices(self, **kw: Any) -> Any:
        self.entered.set()
        self.release.wait()
        if self.hold_generate:  # hold the engine at its first cancel poll (before prefill)
            outer = kw.get("cancel")

            def cancelled() -> bool:
                self.held.set()
                while not (self.resume.is_set() or (outer is not None and outer.is_set())):
                    time.sleep(0.002)
                return outer is not None and outer.is_set()

            kw = {**kw, "cancel": cancelled}
        return self.engine.generate_choices(**kw)

    def stream_choices(self, **kw: Any) -> Iterator[Any]:
        outer = kw.get("cancel")

        def cancelled() -> bool:
            def stop() -> bool:
                return outer is not None and outer.is_set()

            if self.first_taken.is_set():
                self.steps += 1
                while not (self.resume.is_set() or stop()):
                    time.sleep(0.002)
            return stop()

        gen = self.engine.stream_choices(**{**kw, "cancel": cancelled})
        try:
            for item in gen:
                yield item
                if getattr(item, "text", ""):  # a ChoiceDelta with text
                    self.first_taken.set()
        finally:
            gen.close()


def held_refs(cache: Any) -> int:
    """Block references held by requests (0 when every request has released)."""
    return sum(b.ref_count for b in cache.store)


class Scripted:
    """Wraps an engine so that its replies are scripted. It wraps the engine's choices API,
    which the server's bridge calls: the real engine still runs every request (prefill, cache,
    usage, ``n`` choices), then each choice's text is replaced by ``reply`` (one string for
    every choice, a list for choice i to get ``reply[i]``, None: kept), streamed as a
    :class:`PromptDone`, then ``chunk``-character :class:`ChoiceDelta` items taken from the
    choices in turn, one last delta per choice with its finish reason, and the
    :class:`Completion`. ``requests`` keeps each call's keyword arguments and ``results`` each
    request's real choice-0 :class:`GenerationResult` (``prompt_token_ids`` included)."""

    def __init__(self, engine: Any, reply: str | list[str] | None = "", chunk: int = 3) -> None:
        self.engine = engine
        self.reply = reply
        self.chunk = chunk
        self.requests: list[dict[str, Any]] = []
        self.results: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _run(self, kw: dict[str, Any]) -> Any:
        self.requests.append({k: v for k, v in kw.items() if k != "cancel"})
        completion = self.engine.generate_choices(**kw)
        self.results.append(completion.choices[0])
        if self.reply is None:
            return completion
        replies = [self.reply] if isinstance(self.reply, str) else self.reply
        return Completion(
            [
                dataclasses.replace(
                    c,
                    text=replies[c.index % len(replies)],
                    finish_reason="stop",
                    stop_sequence=None,
                    logprobs=None,
                )
                for c in completion.choices
            ]
        )

    def generate_choices(self, **kw: Any) -> Any:
        return self._run(kw)

    def stream_choices(self, **kw: Any) -> Iterator[Any]:
        completion = self._run(kw)
        first = completion.choices[0]
        u = first.usage
        yield PromptDone(Usage(u.prompt_tokens, u.cached_tokens, u.cache_write_tokens, 0), first.outcome)
        longest = max(len(c.text) for c in completion.choices)
        for i in range(0, longest, self.chunk):
            for c in completion.choices:
                if c.text[i : i + self.chunk]:
                    yield ChoiceDelta(c.index, c.text[i : i + self.chunk])
        for c in completion.choices:
            yield ChoiceDelta(c.index, "", finish_reason=c.finish_reason)
        yield completion
