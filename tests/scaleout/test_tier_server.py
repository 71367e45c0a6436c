"""Through the server, with a disk tier and a real Redis: ``DELETE /v1/cache`` removes the caller's
entries from memory, disk and Redis; another tenant's stay and still hit on a new replica."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from prefixcache.cache import PrefixCache
from prefixcache.cache.tiers import attach_tiers, flush_tiers
from prefixcache.engine.engine import Engine
from prefixcache.server import create_app

from .conftest import ServerThread

MODEL = "test-model"
KEYS = {"sk-alpha-0001": "alpha", "sk-beta-0002": "beta"}
SECRET = "deployment-secret"
SYSTEM = "A system prompt both tenants send, word for word, long enough for blocks. " * 6


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replica(tiny_runner: Any, **tiers: Any) -> tuple[Engine, ServerThread, list[Any]]:
    """One replica of the deployment: its own memory, and the shared ``disk_dir``/``redis_url``."""
    cache = PrefixCache(block_size=16)
    added = attach_tiers(cache, secret=SECRET, pin_refresh_s=None, **tiers)
    engine = Engine(tiny_runner, prefill_chunk=16, cache=cache)
    app = create_app(engine, api_keys=KEYS, salt_secret=SECRET, model_name=MODEL)
    return engine, ServerThread(app), added


def cached(url: str, key: str, user: str = "hello") -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=1,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    )
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.redis
def test_delete_v1_cache_removes_the_tenants_entries_from_disk_and_redis_only(
    tiny_runner: Any, redis_url: str, tmp_path: Path, one_torch_thread: None
) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    e1, s1, (disk1, _) = replica(tiny_runner, disk_dir=tmp_path, redis_url=redis_url)
    try:
        with s1:
            assert cached(s1.url, "sk-alpha-0001") == 0
            assert cached(s1.url, "sk-beta-0002") == 0
            flush_tiers(e1.cache)
            blocks = disk1.stats().writes // 2  # the same prompt: each tenant wrote as many blocks
            assert blocks > 0 and disk1.stats().entries == 2 * blocks
            assert len(list(client.scan_iter(match="prefixcache:*"))) == 2 * blocks
            r = httpx.delete(s1.url + "/v1/cache", headers={"authorization": "Bearer sk-alpha-0001"})
            assert r.status_code == 200
            assert r.json() == {
                "flushed_blocks": blocks,
                "tier_entries_removed": {"disk": blocks, "redis": blocks},
            }
            assert disk1.stats().entries == blocks
            assert len(list(client.scan_iter(match="prefixcache:*"))) == blocks
    finally:
        e1.close()
    # New replicas, one over each tier alone: alpha's entries are gone from both, beta's hit.
    for tiers, hit_tier in (({"disk_dir": tmp_path}, "disk"), ({"redis_url": redis_url}, "redis")):
        engine, server, (tier,) = replica(tiny_runner, **tiers)
        try:
            with server:
                assert cached(server.url, "sk-alpha-0001") == 0, hit_tier
                assert cached(server.url, "sk-beta-0002") == blocks * 16, hit_tier
                assert (tier.name, tier.stats().hits, tier.stats().corrupt) == (hit_tier, blocks, 0)
            flush_tiers(engine.cache)  # alpha's recomputed blocks: written before the next test starts
        finally:
            engine.close()
