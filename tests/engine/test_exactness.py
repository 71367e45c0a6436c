"""A hit gives bitwise the logits and greedy text of the same request with the cache off."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from prefixcache.engine.engine import Engine, chunk_schedule


def _pair(runner: Any, chunk: int) -> tuple[Engine, Engine]:
    return Engine(runner, prefill_chunk=chunk), Engine(runner, prefill_chunk=chunk, enable_cache=False)


def _same(on: Engine, off: Engine, ids: list[int], max_tokens: int = 6) -> Any:
    a = on.generate(prompt_token_ids=ids, max_tokens=max_tokens, return_logits=True)
    b = off.generate(prompt_token_ids=ids, max_tokens=max_tokens, return_logits=True)
    assert torch.equal(a.first_logits, b.first_logits), (len(ids), a.usage)
    assert a.tokens == b.tokens and a.text == b.text
    return a


def test_chunk_schedule_is_absolute() -> None:
    assert chunk_schedule(0, 70, 32) == [(0, 32), (32, 64), (64, 70)]
    assert chunk_schedule(64, 70, 32) == [(64, 70)]
    with pytest.raises(ValueError):
        chunk_schedule(16, 70, 32)


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_random_prompts_and_divergence_points(tiny_runner: Any, chunk: int) -> None:
    rng = random.Random(chunk)
    on, off = _pair(tiny_runner, chunk)
    hits = 0
    for _ in range(12):
        base = [rng.randrange(0, 256) for _ in range(rng.randrange(1, 260))]
        _same(on, off, base)
        # diverge anywhere: mid-block, on a block edge, on a chunk edge, before the first block
        cut = rng.choice([rng.randrange(0, len(base) + 1), (len(base) // 16) * 16, (len(base) // chunk) * chunk, 5])
        other = base[:cut] + [rng.randrange(0, 256) for _ in range(rng.randrange(1, 90))]
        hits += _same(on, off, other).usage.cached_tokens > 0
        _same(on, off, base)  # the original again: a full hit where it has complete chunks
    assert hits > 0
    on.cache.check_integrity()


def test_prompt_shorter_than_one_block(tiny_runner: Any) -> None:
    on, off = _pair(tiny_runner, 16)
    for ids in ([7], [1, 2, 3], list(range(15))):
        r = _same(on, off, ids)
        r2 = _same(on, off, ids)
        assert r.usage.cached_tokens == r2.usage.cached_tokens == 0 and r.usage.cache_write_tokens == 0


def test_partial_chunk_blocks_never_poison_a_longer_prompt(tiny_runner: Any) -> None:
    """A prompt ending mid-chunk is followed by longer prompts over the same prefix: blocks of
    a partial chunk are not stored, so later hits stay exact."""
    on, off = _pair(tiny_runner, 64)
    rng = random.Random(3)
    ids = [rng.randrange(0, 256) for _ in range(300)]
    first = _same(on, off, ids[:100])  # chunks [0,64) [64,100): only [0,64) is stored
    assert first.usage.cache_write_tokens == 64
    second = _same(on, off, ids[:200])
    assert (second.usage.cached_tokens, second.usage.cache_write_tokens) == (64, 128)
    third = _same(on, off, ids[:260])
    assert third.usage.cached_tokens == 192


@pytest.mark.model
def test_real_model_hit_after_miss_is_exact(real_runner: Any) -> None:
    on, off = _pair(real_runner, 512)
    system = "You are a careful assistant for a bakery. " + " ".join(
        f"Example {i}: the customer asks about bread number {i}; you answer politely with its price." for i in range(30)
    )
    q1 = [{"role": "system", "content": system}, {"role": "user", "content": "What is the price of bread 3?"}]
    q2 = [{"role": "system", "content": system}, {"role": "user", "content": "Do you sell croissants?"}]
    n = len(on.render_ids(q1))
    assert n > 512
    a = on.generate(messages=q1, max_tokens=8, return_logits=True)
    assert a.usage.cached_tokens == 0 and a.usage.cache_write_tokens == (n // 512) * 512
    b = on.generate(messages=q2, max_tokens=8, return_logits=True)
    assert b.usage.cached_tokens == 512
    ref = off.generate(messages=q2, max_tokens=8, return_logits=True)
    assert torch.equal(b.first_logits, ref.first_logits)
    assert b.text == ref.text and b.tokens == ref.tokens
