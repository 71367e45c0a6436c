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
- ``require_binary`` (session): ``require_binary(name, install)`` -> the binary's path. Without
  it the test skips, except under CI (``$CI`` set), where it fails: a CI run that cannot test
  the shared tier or the HTML report must go red, not green with skips.
- ``redis_server_bin``, ``chromium_bin`` (session): ``require_binary`` of the two the suite needs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from prefixcache.cache import FakeClock

#: Binaries the suite needs, and how to get them (``.ci/run`` installs both).
INSTALL_HINTS = {
    "redis-server": "apt-get install redis-server",
    "chromium": "apt-get install chromium",
}


def find_required_binary(name: str, install: str) -> str:
    """The path of ``name`` on PATH. Missing: ``pytest.fail`` when ``$CI`` is set (the message
    names the binary and how to install it), ``pytest.skip`` otherwise."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not on PATH: install it ({install}; .ci/run does)"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set and {message}: the tests that need it cannot be skipped in CI", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def require_binary() -> Callable[[str, str], str]:
    return find_required_binary


@pytest.fixture(scope="session")
def redis_server_bin() -> str:
    return find_required_binary("redis-server", INSTALL_HINTS["redis-server"])


@pytest.fixture(scope="session")
def chromium_bin() -> str:
    return find_required_binary("chromium", INSTALL_HINTS["chromium"])


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
