"""Server fixtures: ``serve(engine, **create_app_kwargs)`` starts the real app under uvicorn on
a free loopback port in a background thread and returns a :class:`RunningServer` once /health
answers; every server started is stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_helpers import RunningServer

from prefixcache.server import create_app


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
