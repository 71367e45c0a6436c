"""The check every engine test and server test ends with: each engine still alive proves its KV
pool consistent (``Engine.check_integrity``: free + cache-held + held by running requests =
every block, and the cache's own invariants), so a scenario that leaks or double-frees a block
fails where it happens. A conftest takes it with ``from pool_checks import pool_integrity as
pool_integrity``."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from prefixcache.engine.engine import Engine

_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _track(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(self: Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _ENGINES.add(self)

    return wrapper


if not getattr(Engine.__init__, "__wrapped__", None):
    Engine.__init__ = _track(Engine.__init__)  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def pool_integrity() -> Iterator[None]:
    """Check every live engine's pool and cache after the test (after its own fixtures closed
    what they opened: an autouse fixture is set up first and torn down last)."""
    yield
    for engine in list(_ENGINES):
        engine.check_integrity()
