"""Flows on the embedded SmolLM2 (``-m model``): busting, and usage through the real template."""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache.engine.demo import flow_busting

pytestmark = pytest.mark.model


def test_busting_at_the_top_kills_hits_and_at_the_bottom_restores_them(real_runner: Any) -> None:
    from prefixcache.engine.engine import select_runner

    own = select_runner(real_runner)  # the own runner: every full 16-token block
    top, bottom = flow_busting(own, max_tokens=1, requests=2, repeat=3)  # ~700-token prompts
    # a timestamp near the top: only the blocks before it are shared
    assert [r.usage.cached_tokens for r in top.results][0] == 0
    assert top.results[1].usage.cached_tokens < 64
    first, second = bottom.results
    n = first.usage.prompt_tokens
    assert first.usage.cached_tokens == 0 and first.usage.cache_write_tokens == n // 16 * 16
    assert second.usage.cached_tokens > n - 64  # all but the moved timestamp's tail
    assert top.hit_rate < 0.05 and bottom.hit_rate > 0.45


def test_busting_with_the_hf_runner_at_its_512_token_granularity(real_runner: Any) -> None:
    top, bottom = flow_busting(real_runner, max_tokens=1, requests=2, repeat=3)  # the HF runner as given
    assert [r.usage.cached_tokens for r in top.results] == [0, 0]
    first, second = bottom.results
    assert first.usage.cached_tokens == 0 and first.usage.cache_write_tokens == 512
    assert second.usage.cached_tokens == 512 and second.outcome == "hit"
    assert top.hit_rate == 0.0 and bottom.hit_rate > 0.3  # 1 miss, then 512 of ~700 tokens


def test_real_engine_fixture_counts_and_serves_after_errors(real_engine: Any) -> None:
    msgs = [{"role": "user", "content": "Say hi."}]
    assert real_engine.count_tokens(messages=msgs) == len(real_engine.render_ids(msgs))
    with pytest.raises(ValueError, match="8192"):
        real_engine.generate(prompt_token_ids=[42] * 8200, max_tokens=1)
    r = real_engine.generate(messages=msgs, max_tokens=3)
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens >= 1
