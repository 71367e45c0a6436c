"""Server fixtures: ``serve(engine, **create_app_kwargs)`` starts the real app under uvicorn on
a free loopback port in a background thread and returns its base URL once /health answers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from prefixcache.server import create_app

from .fake_engine import FakeEngine


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


@pytest.fixture
def serve() -> Iterator[Callable[..., RunningServer]]:
    started: list[RunningServer] = []

    def start(engine: Any, **kwargs: Any) -> RunningServer:
        server = RunningServer(create_app(engine, **kwargs), engine).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (no timing assertion: the timeout only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
