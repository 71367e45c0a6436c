"""Shared fixtures of every test package (kept stable: other teams build on these names).

- ``fake_clock``: a :class:`prefixcache.cache.FakeClock` at t=0 (``.now``, ``.advance(s)``, callable).
- ``tiny_runner`` (session): a random 2-layer Llama + byte-level chat tokenizer; loads in ~1 s.
- ``tiny_engine``: a fresh Engine over ``tiny_runner``, cache on, block 16, prefill_chunk 16,
  its cache on ``fake_clock`` (``tiny_engine.clock is fake_clock``).
- ``real_runner`` (session): the embedded SmolLM2-135M-Instruct, loaded once per session
  (the first load ever converts the GGUF, ~30 s; later loads a few seconds). Tests that use it
  carry ``@pytest.mark.model``.
- ``real_engine``: a fresh Engine over ``real_runner``, default settings (prefill_chunk 512),
  its cache on ``fake_clock``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prefixcache.cache import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock(0.0)


@pytest.fixture(scope="session")
def tiny_runner() -> Any:
    from prefixcache.engine.model import ModelRunner

    return ModelRunner.tiny(seed=0)


@pytest.fixture
def tiny_engine(tiny_runner: Any, fake_clock: FakeClock) -> Iterator[Any]:
    from prefixcache.engine.engine import Engine

    engine = Engine(tiny_runner, prefill_chunk=16, clock=fake_clock)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def real_runner() -> Any:
    from prefixcache.engine.model import ModelRunner

    return ModelRunner.load()


@pytest.fixture
def real_engine(real_runner: Any, fake_clock: FakeClock) -> Iterator[Any]:
    from prefixcache.engine.engine import Engine

    engine = Engine(real_runner, clock=fake_clock)
    yield engine
    engine.close()
