"""prefixcache: an LLM inference engine, server and toolkit built around exact prefix caching.

    from prefixcache import Engine
    engine = Engine()                      # embedded SmolLM2-135M-Instruct, cache on
    r = engine.generate(prompt="Hello", max_tokens=16)

Heavy modules (torch, transformers) load on first use of :class:`Engine`, so the cache layer and
the analysis tools import quickly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

__all__ = ["Engine", "PrefixCache", "CacheStats", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from prefixcache.cache.manager import PrefixCache
    from prefixcache.cache.stats import CacheStats
    from prefixcache.engine.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from prefixcache.engine.engine import Engine

        return Engine
    if name == "PrefixCache":
        from prefixcache.cache.manager import PrefixCache

        return PrefixCache
    if name == "CacheStats":
        from prefixcache.cache.stats import CacheStats

        return CacheStats
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
