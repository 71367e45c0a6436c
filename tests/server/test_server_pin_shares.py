"""Per-tenant pin budgets: with two tenants or more, one tenant may pin at most its share of the
pinned budget (409 ``tenant_pin_budget`` naming the limit beyond), so another tenant can still
pin while the first has filled its share; a server with one tenant keeps the whole budget."""

from __future__ import annotations

import math
import random

import httpx
import pytest
import torch

from prefixcache.cache import PrefixCache, TenantPinBudgetExceeded

MODEL = "test-model"
KEYS = {"sk-alpha-0001": "alpha", "sk-beta-0002": "beta"}
ALPHA = {"authorization": "Bearer sk-alpha-0001"}
BETA = {"authorization": "Bearer sk-beta-0002"}


def ids(seed: int, blocks: int) -> list[int]:
    """A prompt of exactly ``blocks`` full 16-token blocks plus one token."""
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(16 * blocks + 1)]


def pin(url: str, headers: dict[str, str], prompt: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/cache/pin", headers=headers, json={"prompt_token_ids": prompt}, timeout=60)


@pytest.fixture
def block_nbytes(make_engine) -> int:
    """One cached block's bytes in the engine's KV dtype (float32: 4 bytes an element, bfloat16: 2)."""
    probe = make_engine()
    layout = probe.block_layout
    return math.prod(layout.shape) * getattr(torch, layout.dtype).itemsize


def test_one_tenant_cannot_take_the_whole_pin_budget(serve, make_engine, block_nbytes):
    engine = make_engine(pinned_capacity_bytes=8 * block_nbytes)  # 8 blocks; a share of 0.5 is 4
    server = serve(engine, model_name=MODEL, api_keys=KEYS, salt_secret="s", tenant_pin_share=0.5)
    r = pin(server.url, ALPHA, ids(1, 3))
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 48
    r = pin(server.url, ALPHA, ids(2, 2))  # 3 + 2 > 4 blocks: refused, nothing pinned
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "tenant_pin_budget"
    limit = 4 * block_nbytes
    assert f"{3 * block_nbytes} of its {limit} bytes are pinned" in error["message"]
    assert (
        "--tenant-pin-share is 0.5" in error["message"]
        and f"needs {2 * block_nbytes} more" in error["message"]
    )
    assert engine.cache.stats().pinned_blocks == 3
    # Beta is not affected by alpha's full share.
    r = pin(server.url, BETA, ids(3, 4))
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 64
    assert engine.cache.stats().pinned_blocks == 7
    # Alpha unpins and can pin the other prefix now.
    r = httpx.request(
        "DELETE", server.url + "/v1/cache/pin", headers=ALPHA, json={"prompt_token_ids": ids(1, 3)}
    )
    assert r.json() == {"unpinned_tokens": 48}
    assert pin(server.url, ALPHA, ids(2, 2)).status_code == 200
    engine.cache.check_integrity()  # the per-tenant pinned bytes agree with the store


def test_a_single_tenant_server_keeps_the_whole_pin_budget(serve, make_engine, block_nbytes):
    engine = make_engine(pinned_capacity_bytes=8 * block_nbytes)
    server = serve(engine, model_name=MODEL, tenant_pin_share=0.5)
    assert pin(server.url, {}, ids(4, 6)).status_code == 200  # 6 of 8 blocks: more than half
    r = pin(server.url, {}, ids(5, 3))  # 6 + 3 > 8: the whole budget is full
    assert r.status_code == 409 and r.json()["error"]["code"] == "pin_budget"


def test_pin_share_accounting_in_the_cache() -> None:
    from prefixcache.cache import Namespace

    cache = PrefixCache(block_size=4, capacity_bytes=1 << 20, pinned_capacity_bytes=400)
    cache.limit_tenant_pins(0.5)  # 200 bytes a tenant
    a = Namespace.create("m", tenant="a", salt=b"a")
    b = Namespace.create("m", tenant="b", salt=b"b")

    def store(tokens: list[int], ns: Namespace) -> None:
        m = cache.match(tokens, ns)
        cache.commit(m, lambda i: (object(), 100))
        cache.release(m)

    long_a, short_a = list(range(9)), list(range(5))  # 2 blocks; 1 block (a prefix of the first)
    store(long_a, a)
    assert cache.pin(short_a, a) == 4  # 100 bytes
    assert cache.pin(long_a, a) == 8  # only the second block is new: 200 bytes in all
    with pytest.raises(TenantPinBudgetExceeded) as info:
        store(list(range(50, 55)), a)
        cache.pin(list(range(50, 55)), a)
    assert (info.value.tenant, info.value.used, info.value.limit, info.value.needed) == ("a", 200, 200, 100)
    store(list(range(50, 59)), b)
    assert cache.pin(list(range(50, 59)), b) == 8  # b's own 200 bytes
    assert cache.unpin(short_a, a) == 1 * 4  # still pinned by the longer prefix: bytes stay
    with pytest.raises(TenantPinBudgetExceeded):
        cache.pin(list(range(50, 55)), a)
    assert cache.unpin(long_a, a) == 2 * 4
    assert cache.pin(list(range(50, 55)), a) == 4
    cache.check_integrity()
    with pytest.raises(ValueError, match="share"):
        cache.limit_tenant_pins(0.0)
