"""Prompt logprobs in the two shapes clients ask for (the numbers: ``engine/serving/prompt_logprobs.py``).

OpenAI's ``echo`` + ``logprobs`` on ``/v1/completions``: the choice's ``logprobs`` object starts
with the prompt's tokens (the first one's ``token_logprobs`` and ``top_logprobs`` are null: nothing
predicts it), then the generated ones::

    {"tokens": [...prompt, ...output], "token_logprobs": [null, ...], "top_logprobs": [null, {...}],
     "text_offset": [0, ...]}

vLLM's ``prompt_logprobs`` extension (an integer k, 0-20): per prompt position, null for the
first, then ``{"<token id>": {"logprob": float, "rank": int, "decoded_token": str}}`` holding the
prompt's token and the k likeliest (``choices[].prompt_logprobs`` on completions, a top-level
``prompt_logprobs`` on chat).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from prefixcache.engine.serving.detok import TokenText
from prefixcache.engine.types import GenerationSpec
from prefixcache.server.openai.logprobs import FLOOR, completion_logprobs

#: vLLM's bound on ``prompt_logprobs`` (and OpenAI's on ``top_logprobs``).
MAX_PROMPT_LOGPROBS = 20


def _finite(value: float) -> float:
    return value if value > float("-inf") else FLOOR


def echo_logprobs(ids: Sequence[int], entries: Sequence[Any], text: TokenText) -> dict[str, Any]:
    """The prompt's part of a completions ``logprobs`` object (``entries[0]`` is None)."""
    rest = completion_logprobs([e for e in entries[1:]], text)
    return {
        "tokens": [text.text(int(ids[0]))] + rest["tokens"],
        "token_logprobs": [None] + rest["token_logprobs"],
        "top_logprobs": [None] + rest["top_logprobs"],
        "text_offset": [0] + rest["text_offset"],
    }


def join_logprobs(prompt: dict[str, Any], output: dict[str, Any] | None) -> dict[str, Any]:
    """The prompt's logprobs object followed by the output's (same four lists)."""
    if output is None:
        return prompt
    return {k: prompt[k] + output[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def vllm_prompt_logprobs(entries: Sequence[Any], text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` list for these entries."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position: dict[str, Any] = {
            str(e.token): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": text.text(e.token)}
        }
        for rank, (token, lp) in enumerate(e.top, start=1):
            position.setdefault(
                str(token), {"logprob": _finite(lp), "rank": rank, "decoded_token": text.text(token)}
            )
        out.append(position)
    return out


def trim_top(entries: Sequence[Any], k: int) -> list[Any]:
    """The entries with at most ``k`` alternatives each (one computation serves two asks)."""
    return [e if e is None or len(e.top) <= k else replace(e, top=e.top[:k]) for e in entries]


async def prompt_entries(bridge: Any, spec: GenerationSpec, top: int) -> tuple[list[int], list[Any]]:
    """The token ids of ``spec``'s prompt (as the generation will prefill them) and their logprobs."""
    engine = bridge.engine
    ids = await bridge.run(lambda: list(engine.prompt_ids(spec.messages, spec.prompt, spec.prompt_token_ids)))
    entries = await bridge.run(lambda: engine.prompt_logprobs(prompt_token_ids=ids, top=top))
    return ids, entries
