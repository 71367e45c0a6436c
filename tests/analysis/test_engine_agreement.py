"""The simulator and the live engine agree on hit tokens for the same trace.

Both run the real PrefixCache on one FakeClock: the engine prefills on the tiny random model (or
the real SmolLM2 with ``-m model``), the simulator stands a cost model in for it. Gaps straddle
the TTL, so hits, expiries and partial matches all occur.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixcache.analysis.simulate import SimConfig, simulate
from prefixcache.analysis.trace import TraceWriter, load_trace
from prefixcache.cache import FakeClock

TTL = 30.0


def _trace(path: Path, vocab: int, unit: int, requests: int = 14) -> Path:
    """``unit``: the hit granularity (the engine's prefill chunk)."""
    rng = np.random.default_rng(5)
    sys_a = rng.integers(3, vocab, 2 * unit + 3).tolist()
    sys_b = rng.integers(3, vocab, unit + 5).tolist()
    t = 0.0
    with TraceWriter(path) as w:
        for i in range(requests):
            t += [5.0, 12.0, 45.0][i % 3]  # the 45 s gaps outlive the 30 s TTL
            sys = sys_a if i % 4 else sys_b
            tail = rng.integers(3, vocab, int(rng.integers(1, unit + 8))).tolist()
            w.request(t, endpoint="a" if i % 4 else "b", tokens=sys + tail)
    return path


def _engine_cached(engine: Any, tokens: list[int]) -> int:
    """cached_tokens of one generation, across the result shapes the engine may return."""
    for kwargs in ({"prompt_token_ids": tokens}, {"prompt_tokens": tokens}):
        try:
            res = engine.generate(max_tokens=1, **kwargs)
        except TypeError:
            continue
        usage = getattr(res, "usage", res)
        return int(usage["cached_tokens"] if isinstance(usage, dict) else usage.cached_tokens)
    pytest.skip("engine.generate accepts neither prompt_token_ids= nor prompt_tokens=")


def _agree(engine: Any, tmp_path: Path) -> None:
    cache = engine.cache
    clock = getattr(engine, "clock", None)
    if not isinstance(clock, FakeClock):
        clock = FakeClock(0.0)
        cache.clock = clock  # the manager and its store read time only through these
        cache.store.clock = clock
    cache.policy = type(cache.policy)(default_ttl_s=TTL)
    block = cache.block_size
    align = int(getattr(engine, "alignment", None) or getattr(engine, "prefill_chunk", block) or block)
    vocab = int(getattr(getattr(engine, "tokenizer", None), "vocab_size", 0) or 200)
    trace = load_trace(_trace(tmp_path / "agree.jsonl", min(vocab, 5000), max(block, align)))
    live = []
    for i in range(len(trace)):
        clock.set(float(trace.ts[i]))
        live.append(_engine_cached(engine, trace.tokens(i).tolist()))
    sim = simulate(trace, SimConfig(ttl_s=TTL, block_size=block, align_tokens=align, capacity_bytes=1 << 40))
    assert sim.cached.tolist() == live
    assert sum(live) > 0 and 0 in live[1:]  # some hits, and some misses after the TTL


def test_simulator_matches_tiny_engine(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    try:
        engine = request.getfixturevalue("tiny_engine")
    except pytest.FixtureLookupError:
        pytest.skip("the engine's tiny_engine fixture is not there yet (tests/conftest.py)")
    if getattr(engine, "cache", None) is None:
        pytest.skip("tiny_engine has caching off")
    _agree(engine, tmp_path)


@pytest.mark.model
def test_simulator_matches_real_engine(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    try:
        runner = request.getfixturevalue("real_runner")
    except pytest.FixtureLookupError:
        pytest.skip("the engine's real_runner fixture is not there yet (tests/conftest.py)")
    from prefixcache.engine.engine import Engine

    # The own runner: hits at any 16-token block, exactly as the simulator aligned to 16 predicts.
    engine = Engine(runner, prefill_chunk=64, clock=FakeClock(0.0))
    assert engine.alignment == 16
    try:
        _agree(engine, tmp_path)
    finally:
        engine.close()
