"""Server fixtures: ``serve(engine, **create_app_kwargs)`` starts the real app under uvicorn on
a free loopback port in a background thread and returns a :class:`RunningServer` once /health
answers; every server started is stopped at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_helpers import RunningServer

from prefixcache.cache import FakeClock
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


@pytest.fixture
def make_engine(tiny_runner: Any) -> Iterator[Callable[..., Any]]:
    """``make_engine(clock=None, **engine_kwargs)``: a fresh Engine over the session's tiny random
    Llama (byte tokenizer, ChatML template), block 16, prefill chunk 16; closed at teardown."""
    import torch

    from prefixcache.engine import Engine

    # One intra-op thread while the server tests run: the HTTP server, the engine worker and
    # the test share two cores, and two OpenMP threads under contention made the tiny model's
    # prefill ~50x slower here. Restored at teardown.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engines: list[Any] = []

    def make(clock: FakeClock | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("prefill_chunk", 16)
        engine = Engine(tiny_runner, clock=clock, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
    torch.set_num_threads(threads)
