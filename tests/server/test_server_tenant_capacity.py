"""``--tenant-capacity-share`` on the server (issue 21, item 6): tenant alpha flooding the cache
with new prompts evicts its own blocks once over its share, so tenant beta's warm prompts stay
cached; without the share, one LRU evicts beta's older blocks first (the control)."""

from __future__ import annotations

import math
import random

import httpx
import pytest
import torch

MODEL = "test-model"
KEYS = {"sk-alpha-0001": "alpha", "sk-beta-0002": "beta"}
ALPHA = {"authorization": "Bearer sk-alpha-0001"}
BETA = {"authorization": "Bearer sk-beta-0002"}


def ids(seed: int) -> list[int]:
    """A prompt of two full 16-token blocks plus one token."""
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(33)]


def cached(url: str, headers: dict[str, str], prompt: list[int]) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(url + "/v1/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("share", [0.5, None])
def test_a_flooding_tenant_evicts_its_own_blocks_over_its_share(serve, make_engine, share):
    probe = make_engine()
    block_nbytes = math.prod(probe.block_layout.shape) * getattr(torch, probe.block_layout.dtype).itemsize
    engine = make_engine(capacity_bytes=10 * block_nbytes, reasons_bytes=0)  # 10 blocks
    server = serve(engine, model_name=MODEL, api_keys=KEYS, salt_secret="s" * 16, tenant_capacity_share=share)
    beta = [ids(1), ids(2)]  # beta's 4 blocks, warm
    assert [cached(server.url, BETA, p) for p in beta] == [0, 0]
    for seed in range(10, 18):  # alpha: 8 new prompts, 16 blocks
        assert cached(server.url, ALPHA, ids(seed)) == 0
    held = engine.cache.stats(tenant="alpha").blocks, engine.cache.stats(tenant="beta").blocks
    if share is not None:
        # alpha grew into the free room (6 blocks), then paid for each new block with its own
        assert held == (6, 4)
        assert [cached(server.url, BETA, p) for p in beta] == [32, 32]
    else:
        assert held == (10, 0)  # beta's blocks were the least recently used: all gone
        assert [cached(server.url, BETA, p) for p in beta] == [0, 0]
