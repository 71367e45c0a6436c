"""Prompt logprobs: every prompt token's logprob, recomputed with the cache bypassed.

    entries = prompt_logprobs(runner, ids, top=5)   # entries[0] is None (nothing predicts it)
    entries[i].logprob                              # log P(ids[i] | ids[:i]), float32

A hit reads its cached positions' KV, not their logits, so a prompt's logprobs need its rows
computed again. They are, here, from position 0 in a private KV pool (nothing of the cache is read
or written): each step computes up to ``chunk`` rows as one prefill segment that returns every
row's logits (``Segment.all_logits``). The own runner's rows do not depend on the pass that
computes them (docs/engine.md), so each row is bitwise what a cold run of the prompt cut there
gives as its last row, whatever the cache holds and whatever else the engine is running; the
logprob is the same 1-D log-softmax the sampler's logprobs use (:func:`token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.serving.detok import TextAssembler
from prefixcache.engine.serving.sampling import InvalidRequestError, token_logprobs

#: Rows per step: bounds how long one step holds the runner (other requests' steps wait for it).
DEFAULT_CHUNK = 256


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it (the fields of
    :class:`~prefixcache.engine.types.TokenLogprob`) and ``rank``: 1 + how many tokens the model
    found likelier at that position (vLLM's ``prompt_logprobs`` reports it)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    text_offset: int = 0
    rank: int = 1


def prompt_logprobs(
    runner: Any,
    ids: Sequence[int],
    top: int,
    *,
    tokenizer: Any = None,
    block_size: int = 16,
    chunk: int = DEFAULT_CHUNK,
) -> list[PromptLogprob | None]:
    """One entry per prompt token: None for the first, then each token's logprob given the
    tokens before it and its ``top`` most likely alternatives at that position. ``text_offset``:
    where the token's text starts in the decoded prompt (with ``tokenizer``; else 0)."""
    if not isinstance(runner, LlamaRunner):
        raise InvalidRequestError(
            "prompt logprobs need the own Llama runner (every prompt row recomputed exactly); this "
            "engine runs the Hugging Face runner"
        )
    n = len(ids)
    offsets = _offsets(tokenizer, ids) if tokenizer is not None else [0] * n
    out: list[PromptLogprob | None] = [None]
    if n < 2:
        return out
    pool = runner.new_pool(-(-n // block_size) + 1, block_size)  # block 0 pads
    blocks = []
    for _ in range(-(-n // block_size)):
        block = pool.alloc()
        if block is None:  # (the pool was sized for exactly these blocks)
            raise RuntimeError("prompt logprobs: the scratch KV pool is exhausted (a bug)")
        blocks.append(block)
    table = [b.index for b in blocks]
    for start in range(0, n - 1, chunk):  # row p predicts token p + 1; the last row is not needed
        stop = min(n - 1, start + chunk)
        segment = Segment([int(t) for t in ids[start:stop]], start, table, want_logits=True, all_logits=True)
        logits = runner.step(pool, [segment])
        for i, p in enumerate(range(start, stop)):
            token = int(ids[p + 1])
            row = logits[i]
            lp, best = token_logprobs(row, token, top)
            rank = int((row > row[token]).sum()) + 1
            out.append(PromptLogprob(token, lp, best, offsets[p + 1], rank))
    del blocks
    return out


def _offsets(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Where each token's text starts in the prompt decoded token by token (a token ending in
    the middle of a character starts where that character does)."""
    text = TextAssembler(tokenizer)
    offsets = []
    for token in ids:
        offsets.append(len(text.text))
        text.push(int(token))
    return offsets


__all__ = ["DEFAULT_CHUNK", "PromptLogprob", "prompt_logprobs"]
