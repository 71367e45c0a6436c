"""The engine carries each request's miss reason in its usage, on both runners: the own
batched one (hits at every block) and the Hugging Face one (hits on prefill-chunk boundaries,
so a divergence is read back to the chunk before it)."""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache.cache import FakeClock
from prefixcache.cache.reasons import Reason
from prefixcache.engine import Engine


@pytest.mark.parametrize(("kind", "chunk"), [("auto", 16), ("hf", 32)])
def test_reasons_through_the_engine(tiny_runner: Any, kind: str, chunk: int) -> None:
    clock = FakeClock(50.0)
    engine = Engine(tiny_runner, prefill_chunk=chunk, runner=kind, clock=clock, default_ttl_s=60.0)
    try:
        ids = list(range(1, 200))  # 199 tokens: 12 full blocks, at most 198 readable
        may_read = 198 // chunk * chunk

        def reason(prompt: list[int]):
            c = engine.generate_choices(prompt=prompt, max_tokens=1)
            return c.usage, c.usage.cache_reason

        usage, r = reason(ids)
        assert r.reason is Reason.NEW_PREFIX and usage.cached_tokens == 0
        usage, r = reason(ids)
        assert r.reason is Reason.FULL_HIT and usage.cached_tokens == may_read
        edited = list(ids)
        edited[70] = 250  # token 70: block 4, chunk 2 of 32
        usage, r = reason(edited)
        read = 70 // chunk * chunk
        assert (r.reason, r.token_index, usage.cached_tokens) == (Reason.DIVERGED, 70, read)
        assert r.cache_missed_tokens == may_read - read
        clock.advance(90.0)  # the blocks were last used at 50: they expired 30 s ago
        usage, r = reason(ids)
        assert (r.reason, r.ago_s, r.cache_missed_tokens) == (Reason.EXPIRED, 30.0, may_read)
    finally:
        engine.close()
