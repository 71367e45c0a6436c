"""The ``prefixcache`` object every generation answer carries: why the cache read ended where it
did (see :mod:`prefixcache.cache.reasons`), beside the route's ``usage``::

    "prefixcache": {"reason": "diverged", "cached_tokens": 32, "cache_missed_tokens": 480,
                    "divergence": {"token_index": 41, "text_before": "...", "prompt_text": "...",
                                   "cached_text": "..."}}

``expired`` adds ``expired_ago_s`` (since the block's TTL ran out); ``evicted`` and ``flushed``
add ``removed_ago_s``. Everything in it comes from the caller's own namespace; ``cached_text``
decodes the cached side, which is shown only under the rules of
:mod:`~prefixcache.server.caller_text` (with API keys: only when the same key wrote it). When
it is withheld, ``cached_text`` is null and ``cached_text_hidden`` true: the token index and the
caller's own text remain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixcache.cache.reasons import Reason
from prefixcache.cache.stats import Usage


def prefixcache_object(usage: Usage, decode: Callable[[list[int]], str]) -> dict[str, Any] | None:
    """The answer's ``prefixcache`` object, or None when no cache was asked (``--no-cache``)."""
    r = usage.cache_reason
    if r is None:
        return None
    out: dict[str, Any] = {
        "reason": r.reason.value,
        "cached_tokens": usage.cached_tokens,
        "cache_missed_tokens": r.cache_missed_tokens,
    }
    if r.token_index is not None:
        out["divergence"] = {
            "token_index": r.token_index,
            "text_before": decode(list(r.before)),
            "prompt_text": decode(list(r.prompt_after)),
            "cached_text": None if r.cached_hidden else decode(list(r.cached_after)),
        }
        if r.cached_hidden:  # another caller's prompt: its structure only
            out["divergence"]["cached_text_hidden"] = True
    if r.ago_s is not None:
        out["expired_ago_s" if r.reason is Reason.EXPIRED else "removed_ago_s"] = round(r.ago_s, 3)
    return out


def prefixcache_field(usage: Usage, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """``{"prefixcache": ...}`` to spread beside an answer's ``usage`` (empty without a cache)."""
    obj = prefixcache_object(usage, decode)
    return {} if obj is None else {"prefixcache": obj}
