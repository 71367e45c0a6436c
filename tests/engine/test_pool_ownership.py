"""Explicit KV pool ownership: every scenario leaves free + cache-held + request-held = every
block (``Engine.check_integrity``), and a hold nobody accounts for is found."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from prefixcache.cache import PrefixCache
from prefixcache.cache.tiers import attach_tiers, flush_tiers
from prefixcache.engine.engine import Engine
from prefixcache.engine.pool import PoolBlock, PoolIntegrityError
from prefixcache.engine.types import ChoiceDelta, Completion


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def _idle_consistent(engine: Engine) -> None:
    """Nothing runs: every block in use is the cache's."""
    engine.check_integrity()
    assert engine.pool is not None
    assert engine.pool.used_blocks == engine.pool.cache_held_blocks
    assert engine.worker_stats().reserved_blocks == 0 and engine.worker_stats().running == 0


def test_a_request_that_fails_mid_prefill_gives_its_blocks_back(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    real_step = engine.runner.step
    calls = {"n": 0}

    def failing_step(pool: Any, segments: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # two chunks prefilled (and committed), then the third pass fails
            raise RuntimeError("boom in prefill")
        return real_step(pool, segments)

    engine.runner.step = failing_step  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="boom in prefill"):
            engine.generate(prompt_token_ids=_ids(1, 70), max_tokens=4)
    finally:
        del engine.runner.step
    assert engine.pool is not None and engine.pool.cache_held_blocks == 2  # the two committed blocks
    _idle_consistent(engine)
    assert engine.generate(prompt_token_ids=_ids(1, 70), max_tokens=2).usage.cached_tokens == 32
    _idle_consistent(engine)


def test_a_cancelled_stream_gives_its_blocks_back(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    gen = engine.stream_choices(prompt_token_ids=_ids(2, 50), max_tokens=200, n=2, temperature=1.0, seed=3)
    for item in gen:
        if isinstance(item, ChoiceDelta):
            engine.check_integrity()  # mid-decode: the running request's holds are counted
            break
    gen.close()
    _idle_consistent(engine)


def test_a_cancel_signal_mid_decode_aborts_and_frees(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    stop = threading.Event()
    seen = 0
    with pytest.raises(Exception, match="cancelled"):
        for item in engine.stream_choices(prompt_token_ids=_ids(3, 40), max_tokens=200, cancel=stop):
            if isinstance(item, ChoiceDelta):
                seen += 1
                if seen == 3:
                    stop.set()
    _idle_consistent(engine)


def test_blocks_the_cache_evicts_go_back_to_the_pool(tiny_runner: Any) -> None:
    probe = Engine(tiny_runner, prefill_chunk=16)
    assert probe.pool is not None
    engine = Engine(
        tiny_runner, prefill_chunk=16, capacity_bytes=4 * probe.pool.block_nbytes, reasons_bytes=0
    )
    assert engine.pool is not None
    for seed in range(6):
        engine.generate(prompt_token_ids=_ids(10 + seed, 40), max_tokens=2)  # 2 full blocks each
        _idle_consistent(engine)
    assert engine.stats().evictions.get("capacity", 0) >= 8
    assert engine.pool.cache_held_blocks == 4


def test_a_flushed_namespace_frees_its_blocks_once_its_reader_ends(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    assert engine.pool is not None and engine.cache is not None
    ids = _ids(4, 50)
    engine.generate(prompt_token_ids=ids, max_tokens=1)
    gen = engine.stream(prompt_token_ids=ids, max_tokens=100)
    next(gen)  # running, reading the 3 cached blocks: the cache keeps what a request holds
    assert engine.cache.flush(engine.namespace()) == 0
    engine.check_integrity()
    gen.close()
    assert engine.cache.flush(engine.namespace()) == 3
    _idle_consistent(engine)
    assert engine.pool.used_blocks == 0


def test_choices_share_the_prompt_blocks_one_hold_each(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    assert engine.pool is not None
    ids = _ids(5, 40)  # 2 full blocks + a partial one
    holds: list[int] = []
    for item in engine.stream_choices(prompt_token_ids=ids, max_tokens=20, n=3, temperature=1.0, seed=1):
        if isinstance(item, ChoiceDelta) and not holds:
            engine.check_integrity()
            holds.append(engine.pool.used_blocks)
        if isinstance(item, Completion):
            assert len(item.choices) == 3
    # while decoding: 2 shared full blocks, 3 partial tails (one each); the blocks held once each
    assert holds == [5]
    _idle_consistent(engine)


def test_a_leaked_hold_is_detected(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    assert engine.pool is not None and engine.cache is not None
    engine.generate(prompt_token_ids=_ids(6, 40), max_tokens=1)
    block = next(b.payload for b in engine.cache.store)
    assert isinstance(block, PoolBlock)
    engine.pool.hold(block)  # a hold no request accounts for
    with pytest.raises(
        PoolIntegrityError, match=rf"block {block.index}: 1 request holds counted, 0 found \(a leaked hold\)"
    ):
        engine.check_integrity()
    engine.pool.free(block)
    _idle_consistent(engine)


def test_a_double_free_is_refused(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    assert engine.pool is not None
    block = engine.pool.alloc()
    assert block is not None
    engine.pool.free(block)
    with pytest.raises(PoolIntegrityError, match="holds nothing"):
        engine.pool.free(block)
    with pytest.raises(PoolIntegrityError, match="not allocated"):
        engine.pool.hold(block)  # a stale handle: its block is free (and may be handed out again)
    _idle_consistent(engine)  # refused, so nothing changed


def test_blocks_promoted_from_a_disk_tier_are_the_caches(tiny_runner: Any, tmp_path: Path) -> None:
    def engine_on_disk() -> Engine:
        cache = PrefixCache(block_size=16)
        attach_tiers(cache, pin_refresh_s=None, disk_dir=tmp_path)
        return Engine(tiny_runner, prefill_chunk=16, cache=cache)

    a = engine_on_disk()
    ids = _ids(7, 130)
    a.generate(prompt_token_ids=ids, max_tokens=2)
    assert a.cache is not None
    flush_tiers(a.cache)
    a.close()
    b = engine_on_disk()  # a new process, in effect: its blocks come up from disk into its pool
    r = b.generate(prompt_token_ids=ids, max_tokens=2)
    assert r.usage.cached_tokens == 128
    assert b.pool is not None and b.pool.cache_held_blocks == 8
    _idle_consistent(b)
    b.close()
