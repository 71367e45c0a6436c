"""Server fixtures: ``serve(engine, **create_app_kwargs)`` starts the real app under uvicorn on
a free loopback port in a background thread and returns a :class:`RunningServer` once /health
answers; every server started is stopped at teardown. After every test, every engine still alive
proves its KV pool and its cache consistent (``tests/pool_checks.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_helpers import RunningServer

from pool_checks import pool_integrity as pool_integrity
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
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread while a server test runs: the HTTP server, the engine worker and the
    test share two cores, and two OpenMP threads under contention made prefill ~50x slower
    here (9 s instead of 0.17 s for the tiny model's 750-token prompt). Restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_engine(tiny_runner: Any, one_torch_thread: None) -> Iterator[Callable[..., Any]]:
    """``make_engine(clock=None, **engine_kwargs)``: a fresh Engine over the session's tiny random
    Llama (byte tokenizer, ChatML template), block 16, prefill chunk 16; closed at teardown."""
    from prefixcache.engine import Engine

    engines: list[Any] = []

    def make(clock: FakeClock | None = None, **kwargs: Any) -> Any:
        kwargs.setdefault("prefill_chunk", 16)
        engine = Engine(tiny_runner, clock=clock, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
