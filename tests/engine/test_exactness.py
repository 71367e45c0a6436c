"""A hit gives bitwise the logits and greedy text of the same request with the cache off.

The own runner (default) hits at every 16-token block, also when batched with other requests;
the Hugging Face runner (``runner="hf"``) at prefill-chunk boundaries.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

from prefixcache.engine.engine import Engine, chunk_schedule


def _pair(runner: Any, chunk: int, kind: str = "auto", **kw: Any) -> tuple[Engine, Engine]:
    on = Engine(runner, prefill_chunk=chunk, runner=kind, **kw)
    return on, Engine(runner, prefill_chunk=chunk, runner=kind, enable_cache=False, **kw)


def _same(on: Engine, off: Engine, ids: list[int], max_tokens: int = 6) -> Any:
    a = on.generate(prompt_token_ids=ids, max_tokens=max_tokens, return_logits=True)
    b = off.generate(prompt_token_ids=ids, max_tokens=max_tokens, return_logits=True)
    assert torch.equal(a.first_logits, b.first_logits), (len(ids), a.usage)
    assert a.tokens == b.tokens and a.text == b.text
    return a


def _concurrently(engine: Engine, prompts: list[list[int]], max_tokens: int = 6) -> list[Any]:
    """Run ``prompts`` at once on ``engine`` (one thread each); results in prompt order."""
    out: list[Any] = [None] * len(prompts)

    def call(i: int) -> None:
        out[i] = engine.generate(prompt_token_ids=prompts[i], max_tokens=max_tokens, return_logits=True)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in out)
    return out


def test_chunk_schedule_is_absolute() -> None:
    assert chunk_schedule(0, 70, 32) == [(0, 32), (32, 64), (64, 70)]
    assert chunk_schedule(64, 70, 32) == [(64, 70)]
    with pytest.raises(ValueError):
        chunk_schedule(16, 70, 32)


@pytest.mark.parametrize(("kind", "chunk"), [("auto", 16), ("auto", 48), ("hf", 16), ("hf", 32), ("hf", 64)])
def test_random_prompts_and_divergence_points(tiny_runner: Any, kind: str, chunk: int) -> None:
    rng = random.Random(chunk)
    on, off = _pair(tiny_runner, chunk, kind)
    align = on.alignment
    hits = 0
    for _ in range(12):
        base = [rng.randrange(0, 256) for _ in range(rng.randrange(1, 260))]
        _same(on, off, base)
        # diverge anywhere: mid-block, on a block edge, on a chunk edge, before the first block
        cut = rng.choice(
            [rng.randrange(0, len(base) + 1), (len(base) // 16) * 16, (len(base) // chunk) * chunk, 5]
        )
        other = base[:cut] + [rng.randrange(0, 256) for _ in range(rng.randrange(1, 90))]
        r = _same(on, off, other)
        hits += r.usage.cached_tokens > 0
        # the hit is the longest shared run of full blocks (leaving one token), rounded to the alignment
        shared = next(
            (i for i, (x, y) in enumerate(zip(base, other, strict=False)) if x != y),
            min(len(base), len(other)),
        )
        cached_base = (len(base) // chunk) * chunk if kind == "hf" else (len(base) // 16) * 16
        expect = min(shared, cached_base, len(other) - 1) // align * align
        assert r.usage.cached_tokens == expect, (kind, len(base), cut, len(other))
        _same(on, off, base)  # the original again: a full hit
    assert hits > 0
    on.cache.check_integrity()


def test_prompt_shorter_than_one_block(tiny_runner: Any) -> None:
    on, off = _pair(tiny_runner, 16)
    for ids in ([7], [1, 2, 3], list(range(15))):
        r = _same(on, off, ids)
        r2 = _same(on, off, ids)
        assert r.usage.cached_tokens == r2.usage.cached_tokens == 0 and r.usage.cache_write_tokens == 0


def test_hf_runner_never_stores_partial_chunk_blocks(tiny_runner: Any) -> None:
    """HF runner: a prompt ending mid-chunk is followed by longer prompts over the same prefix;
    blocks of a partial chunk are not stored (their bits depend on the pass), so hits stay exact."""
    on, off = _pair(tiny_runner, 64, "hf")
    rng = random.Random(3)
    ids = [rng.randrange(0, 256) for _ in range(300)]
    first = _same(on, off, ids[:100])  # chunks [0,64) [64,100): only [0,64) is stored
    assert first.usage.cache_write_tokens == 64
    second = _same(on, off, ids[:200])
    assert (second.usage.cached_tokens, second.usage.cache_write_tokens) == (64, 128)
    third = _same(on, off, ids[:260])
    assert third.usage.cached_tokens == 192


def test_own_runner_stores_the_last_partial_chunk_and_stays_exact(tiny_runner: Any) -> None:
    """The own runner computes a row alike in any pass, so the blocks of a prompt's last, partial
    chunk are stored and a longer prompt reads them, bitwise as if it had computed them."""
    on, off = _pair(tiny_runner, 64)
    rng = random.Random(3)
    ids = [rng.randrange(0, 256) for _ in range(300)]
    first = _same(on, off, ids[:100])  # passes [0,64) [64,100): six full blocks, all stored
    assert first.usage.cache_write_tokens == 96
    second = _same(on, off, ids[:200])
    assert (second.usage.cached_tokens, second.usage.cache_write_tokens) == (96, 96)
    third = _same(on, off, ids[:261])
    assert (third.usage.cached_tokens, third.usage.cache_write_tokens) == (192, 64)
    on.cache.check_integrity()


def test_hits_are_exact_when_batched_with_other_requests(tiny_runner: Any) -> None:
    """Requests run at once (prefill chunks and decode rows of others in the same steps) give
    what each gives alone with the cache off."""
    rng = random.Random(11)
    on, off = _pair(tiny_runner, 32, max_batch=8)
    system = [rng.randrange(0, 256) for _ in range(150)]
    on.generate(prompt_token_ids=system + [1, 2, 3], max_tokens=1)  # warm the shared prefix
    prompts = [
        system[: rng.randrange(20, 150)] + [rng.randrange(0, 256) for _ in range(rng.randrange(1, 70))]
        for _ in range(8)
    ]
    results = _concurrently(on, prompts, max_tokens=12)
    assert on.worker_stats().steps > 0
    for ids, r in zip(prompts, results, strict=True):
        ref = off.generate(prompt_token_ids=ids, max_tokens=12, return_logits=True)
        assert torch.equal(r.first_logits, ref.first_logits)
        assert r.tokens == ref.tokens
    assert sum(r.usage.cached_tokens for r in results) > 0
    on.cache.check_integrity()
    assert on.pool.used_blocks == on.cache.stats().blocks  # every block not cached went back


def test_a_burst_sharing_a_prefix_prefills_it_once(tiny_runner: Any) -> None:
    """N cold requests sharing a 160-token prefix arrive together: the first computes it, the
    others wait for its blocks (in-flight dedup) and compute only their own tails."""
    engine = Engine(tiny_runner, prefill_chunk=16, max_batch=8)
    rng = random.Random(5)
    prefix = [rng.randrange(0, 256) for _ in range(160)]
    prompts = [prefix + [rng.randrange(0, 256) for _ in range(20)] for _ in range(5)]
    with engine.runner.lock:  # hold the first step until every request is queued
        threads = [
            threading.Thread(target=engine.generate, kwargs={"prompt_token_ids": p, "max_tokens": 1})
            for p in prompts
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while engine.queue_depth < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    assert engine.worker_stats().prefilled_tokens == 180 + 4 * 20
    stats = engine.stats()
    assert stats.hit_tokens == 4 * 160


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_hits_exact_at_any_block_alone_and_batched(real_runner: Any, dtype: str) -> None:
    on, off = _pair(real_runner, 256, dtype=dtype)
    assert on.runner.dtype_name == dtype
    system = "You are a careful assistant for a bakery. " + " ".join(
        f"Example {i}: the customer asks about bread number {i}; you answer politely with its price."
        for i in range(12)
    )
    q1 = [{"role": "system", "content": system}, {"role": "user", "content": "What is the price of bread 3?"}]
    n = len(on.render_ids(q1))
    a = on.generate(messages=q1, max_tokens=6, return_logits=True)
    assert a.usage.cached_tokens == 0 and a.usage.cache_write_tokens == (n // 16) * 16
    rng = random.Random(dtype)
    base = on.render_ids(q1)
    # non-aligned divergence points: every full block before the cut is read
    prompts = []
    for cut in sorted(rng.sample(range(20, n - 5), 3)):
        prompts.append(base[:cut] + on.tokenize(f" and then something else entirely, number {cut}."))
    r = _same(on, off, prompts[0])
    shared = next(i for i, (x, y) in enumerate(zip(base, prompts[0], strict=False)) if x != y)
    assert r.usage.cached_tokens == min(shared, (n // 16) * 16) // 16 * 16 > 0
    batched = _concurrently(on, prompts[1:] + [base], max_tokens=6)
    for ids, r in zip(prompts[1:] + [base], batched, strict=True):
        ref = off.generate(prompt_token_ids=ids, max_tokens=6, return_logits=True)
        assert r.usage.cached_tokens > 0
        assert torch.equal(r.first_logits, ref.first_logits) and r.tokens == ref.tokens


@pytest.mark.model
def test_real_model_hf_runner_hit_after_miss_is_exact(real_runner: Any) -> None:
    on, off = _pair(real_runner, 512, "hf")
    system = "You are a careful assistant for a bakery. " + " ".join(
        f"Example {i}: the customer asks about bread number {i}; you answer politely with its price."
        for i in range(30)
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
