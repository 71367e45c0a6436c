"""Helpers of the server tests: a live uvicorn server in a thread, an engine gate, waits."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn
from fake_engine import FakeEngine


class RunningServer:
    def __init__(self, app: Any, engine: Any) -> None:
        self.app = app
        self.engine = engine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
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
    """Wraps an engine so a test holds it deterministically.

    ``generate`` sets ``entered`` and waits for ``release``; ``stream`` yields its first item,
    then waits for ``resume`` before pulling each further one (``pulled`` counts items taken).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.entered = threading.Event()
        self.release = threading.Event()
        self.resume = threading.Event()
        self.pulled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, **kw: Any) -> Any:
        self.entered.set()
        self.release.wait()
        return self.engine.generate(**kw)

    def stream(self, **kw: Any) -> Iterator[Any]:
        gen = self.engine.stream(**kw)
        try:
            for item in gen:
                self.pulled += 1
                yield item
                self.resume.wait()
        finally:
            gen.close()


def held_refs(cache: Any) -> int:
    """Block references held by requests (0 when every request has released)."""
    return sum(b.ref_count for b in cache.store)


def make_engine(clock: Any = None) -> Any:
    """The engine under test: the fast model-free engine over the real PrefixCache."""
    return FakeEngine(clock=clock)
