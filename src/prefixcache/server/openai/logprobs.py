"""The engine's per-token logprobs in OpenAI's two shapes.

Chat (``choices[].logprobs``, and per chunk in a stream)::

    {"content": [{"token": str, "logprob": float, "bytes": [int], "top_logprobs": [
        {"token": str, "logprob": float, "bytes": [int]}, ...]}, ...], "refusal": null}

Completions (``choices[].logprobs``, and per chunk in a stream)::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}

A token's ``token`` string is its bytes as UTF-8, with the bytes of a partial character written
as ``\\xNN`` (its ``bytes`` are exact). A completions ``top_logprobs`` entry holds the ``k`` most
likely tokens and always the sampled one (so up to k + 1 entries, as OpenAI documents).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from prefixcache.engine.serving.detok import TokenText
from prefixcache.engine.types import TokenLogprob

#: What a logprob of -inf (a token the model rules out) is sent as: JSON has no infinities.
FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _chat_token(token: int, logprob: float, text: TokenText) -> dict[str, Any]:
    return {"token": text.text(token), "logprob": _finite(logprob), "bytes": list(text.bytes(token))}


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object for these tokens."""
    content = []
    for e in entries:
        item = _chat_token(e.token, e.logprob, text)
        item["top_logprobs"] = [_chat_token(t, lp, text) for t, lp in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs`` object for these tokens; ``offset`` is added to each
    token's ``text_offset`` (the echoed prompt's length, when ``echo`` is on)."""
    top: list[dict[str, float]] = []
    for e in entries:
        best: dict[str, float] = {}
        for t, lp in (*e.top, (e.token, e.logprob)):
            best.setdefault(text.text(t), _finite(lp))  # two ids with one string: the likelier one
        top.append(best)
    return {
        "tokens": [text.text(e.token) for e in entries],
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": [offset + e.text_offset for e in entries],
    }
