"""Tier entries are authenticated: whoever can write to Redis or to the disk-tier directory but
does not hold the server's salt secret cannot get a block served.

The attack: after a replica wrote its blocks, every entry is rewritten with zeroed tensor bytes
and its trailer recomputed as the plain (unkeyed) BLAKE2b the entry format once used. A fresh
replica must not serve any of them and must answer exactly as with the cache off. Entries with
a valid MAC but another shape or dtype than the model's block layout are refused the same way,
before any tensor is built. Each refusal is a counted ``corrupt`` miss and the entry is deleted.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixcache.cache import Namespace, PrefixCache
from prefixcache.cache.tiers import attach_tiers, flush_tiers
from prefixcache.engine.engine import Engine

B = 4
SHAPE = (2, 2, 1, B, 3)  # [layers, 2, kv_heads, B, head_dim]
NS = Namespace.create("tiny|float32|B4|kv1", tenant="t", salt=b"s")
PROMPT = list(range(100, 121))  # 21 tokens: 5 full blocks
SECRET = "deployment-secret-1"
HEADER = struct.Struct("<4sBBBBHHIQ")


def forge_zeroed(entry: bytes) -> bytes:
    """The attack: the tensor bytes zeroed, the 32-byte trailer recomputed as an unkeyed BLAKE2b."""
    _, _, _, ndim, _, klen, plen, tlen, nraw = HEADER.unpack_from(entry, 0)
    start = HEADER.size + klen + plen + tlen + 8 * ndim
    body = entry[:start] + bytes(nraw)
    return body + hashlib.blake2b(body, digest_size=32).digest()


def disk_entries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.kv") if ".tmp" not in p.parts)


def redis_entries(client: Any) -> list[bytes]:
    return sorted(client.scan_iter(match="prefixcache:*:kv:*"))


def payload_for(tokens: list[int], i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(tokens[: (i + 1) * B])) & 0xFFFFFFFF)
    return torch.randn(SHAPE, generator=g)


def run(cache: PrefixCache, tokens: list[int], ns: Namespace = NS) -> tuple[int, list[torch.Tensor]]:
    m = cache.match(tokens, ns)
    try:
        hit = [b.payload.clone() for b in m.blocks]
        cache.commit(m, lambda i: (payload_for(tokens, i), payload_for(tokens, i).nbytes))
        return m.cached_tokens, hit
    finally:
        cache.release(m)


@pytest.fixture(autouse=True)
def deployment_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica here is of one deployment: the salt secret comes from the environment, as
    ``prefixcache cluster`` hands it to its replicas."""
    monkeypatch.setenv("PREFIXCACHE_SALT_SECRET", SECRET)


def make_cache() -> PrefixCache:
    return PrefixCache(block_size=B, capacity_bytes=1 << 20)


# ---------------------------------------------------------------------------- the attack, no model
def test_zeroed_disk_entries_with_a_recomputed_plain_checksum_are_not_served(tmp_path: Path) -> None:
    a = make_cache()
    attach_tiers(a, disk_dir=tmp_path)
    run(a, PROMPT)
    flush_tiers(a)
    files = disk_entries(tmp_path)
    assert len(files) == 5
    for path in files:
        path.write_bytes(forge_zeroed(path.read_bytes()))
    b = make_cache()
    (disk,) = attach_tiers(b, disk_dir=tmp_path)
    cached, _ = run(b, PROMPT)
    assert cached == 0  # block 0 is refused, so the run stops there
    s = disk.stats()
    assert (s.hits, s.corrupt) == (0, 1)
    assert b.stats().tier_hits == 0
    # Block 0's forgery was deleted and B wrote the recomputed block in its place; the others
    # are still forged (B's index skips keys it holds) and are refused, one per lookup, likewise.
    flush_tiers(b)
    c = make_cache()
    (disk_c,) = attach_tiers(c, disk_dir=tmp_path)
    cached, payloads = run(c, PROMPT)
    assert cached == 4 and torch.equal(payloads[0], payload_for(PROMPT, 0))
    assert (disk_c.stats().hits, disk_c.stats().corrupt) == (1, 1)


@pytest.mark.redis
def test_zeroed_redis_entries_with_a_recomputed_plain_checksum_are_not_served(redis_url: str) -> None:
    import redis

    a = make_cache()
    (ra,) = attach_tiers(a, redis_url=redis_url, pin_refresh_s=None)
    run(a, PROMPT)
    ra.flush()
    client = redis.Redis.from_url(redis_url)
    names = redis_entries(client)
    assert len(names) == 5
    for name in names:
        client.set(name, forge_zeroed(client.get(name)), keepttl=True)
    b = make_cache()
    (rb,) = attach_tiers(b, redis_url=redis_url, pin_refresh_s=None)
    assert run(b, PROMPT)[0] == 0
    s = rb.stats()
    assert (s.hits, s.corrupt) == (0, 1)
    # Deleted, and every block rewritten by B's write-through of its recomputed blocks.
    rb.flush()
    c = make_cache()
    (rc,) = attach_tiers(c, redis_url=redis_url, pin_refresh_s=None)
    cached, payloads = run(c, PROMPT)
    assert cached == 20 and (rc.stats().hits, rc.stats().corrupt) == (5, 0)
    assert all(torch.equal(p, payload_for(PROMPT, i)) for i, p in enumerate(payloads))
    rc.flush()  # its expiry refreshes land in this test, not the next


@pytest.mark.redis
def test_replicas_sharing_the_secret_read_each_others_entries_across_processes(redis_url: str) -> None:
    """A child process with the same salt secret writes; this process reads every block, bit
    exact. One with another secret finds nothing (its namespace tags differ, and so would its MAC)."""
    child = f"""
import torch
from prefixcache.cache import Namespace, PrefixCache
from prefixcache.cache.tiers import attach_tiers, flush_tiers
cache = PrefixCache(block_size={B}, capacity_bytes=1 << 20)
attach_tiers(cache, redis_url={redis_url!r}, pin_refresh_s=None)  # secret from the environment
ns = Namespace.create("tiny|float32|B4|kv1", tenant="t", salt=b"s")
tokens = {PROMPT!r}
m = cache.match(tokens, ns)
def payload(i):
    g = torch.Generator().manual_seed(hash(tuple(tokens[: (i + 1) * {B}])) & 0xFFFFFFFF)
    t = torch.randn({SHAPE!r}, generator=g)
    return t, t.nbytes
cache.commit(m, payload)
cache.release(m)
flush_tiers(cache)
"""
    env = {**os.environ, "PREFIXCACHE_SALT_SECRET": SECRET, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=120)
    same = make_cache()
    (rs,) = attach_tiers(same, redis_url=redis_url, pin_refresh_s=None)
    cached, payloads = run(same, PROMPT)
    assert cached == 20 and rs.stats().hits == 5
    assert all(torch.equal(p, payload_for(PROMPT, i)) for i, p in enumerate(payloads))
    other = make_cache()
    (ro,) = attach_tiers(other, redis_url=redis_url, secret="another-deployment", pin_refresh_s=None)
    assert run(other, PROMPT)[0] == 0
    assert (ro.stats().hits, ro.stats().misses) == (0, 1)
    rs.flush()
    ro.flush()


# ---------------------------------------------------------------------------- layout
@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (torch.zeros(2, 2, 1, B, 4), "float32[2, 2, 1, 4, 4]"),  # head_dim 4, not 3
        (torch.zeros(SHAPE, dtype=torch.float16), "float16[2, 2, 1, 4, 3]"),
        (torch.zeros(2, 2, 1, B * 3), "float32[2, 2, 1, 12]"),  # same bytes, another shape
    ],
)
def test_entries_with_a_valid_mac_but_another_layout_are_refused_before_a_tensor(
    tmp_path: Path, bad: torch.Tensor, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    from prefixcache.cache.tiers import BlockLayout, TensorCodec

    a = make_cache()
    (disk_a,) = attach_tiers(a, disk_dir=tmp_path)
    run(a, PROMPT)
    flush_tiers(a)
    keys = a.block_keys(PROMPT, NS)
    codec = TensorCodec.from_secret(SECRET)  # the deployment's own key: only the layout is wrong
    path = disk_a.path_of(keys[1])
    path.write_bytes(codec.encode(keys[1], keys[0], _tokens(1), bad))
    b = make_cache()
    b.set_block_layout(BlockLayout(SHAPE, "float32"))
    (disk_b,) = attach_tiers(b, disk_dir=tmp_path)
    cached, payloads = run(b, PROMPT)
    assert cached == 4 and torch.equal(payloads[0], payload_for(PROMPT, 0))
    assert (disk_b.stats().hits, disk_b.stats().corrupt) == (1, 1)
    assert f"layout {reason} is not the model's block layout float32[2, 2, 1, 4, 3]" in caplog.text
    flush_tiers(b)  # deleted, then written again from the recomputed block: genuine now
    entry = codec.decode(path.read_bytes(), key=keys[1], layout=BlockLayout(SHAPE, "float32"))
    assert torch.equal(entry.payload, payload_for(PROMPT, 1))


def _tokens(i: int) -> bytes:
    return struct.pack(f"<{B}I", *PROMPT[i * B : (i + 1) * B])


# ---------------------------------------------------------------------------- engines, end to end
def _prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _engine(runner: Any, chunk: int = 16, **tiers: Any) -> tuple[Engine, list[Any]]:
    cache = PrefixCache(block_size=16)
    added = attach_tiers(cache, pin_refresh_s=None, **tiers)
    return Engine(runner, prefill_chunk=chunk, cache=cache), added


def _same_as_cache_off(on: Engine, off: Engine, ids: list[int]) -> Any:
    a = on.generate(prompt_token_ids=ids, max_tokens=6, return_logits=True)
    b = off.generate(prompt_token_ids=ids, max_tokens=6, return_logits=True)
    assert torch.equal(a.first_logits, b.first_logits)
    assert a.tokens == b.tokens and a.text == b.text
    return a


@pytest.mark.redis
def test_forged_entries_in_both_tiers_leave_a_fresh_replica_exactly_as_cache_off(
    tiny_runner: Any, redis_url: str, tmp_path: Path
) -> None:
    import redis

    off = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    a, _ = _engine(tiny_runner, disk_dir=tmp_path, redis_url=redis_url)
    ids = _prompt(7)
    try:
        _same_as_cache_off(a, off, ids)
        flush_tiers(a.cache)
        a.close()
        client = redis.Redis.from_url(redis_url)
        for name in redis_entries(client):
            client.set(name, forge_zeroed(client.get(name)), keepttl=True)
        for path in disk_entries(tmp_path):
            path.write_bytes(forge_zeroed(path.read_bytes()))
        b, (db, rb) = _engine(tiny_runner, disk_dir=tmp_path, redis_url=redis_url)
        try:
            r = _same_as_cache_off(b, off, ids)
            assert r.usage.cached_tokens == 0
            assert (db.stats().corrupt, db.stats().hits) == (1, 0)
            assert (rb.stats().corrupt, rb.stats().hits) == (1, 0)
        finally:
            b.close()
    finally:
        off.close()


@pytest.mark.redis
@pytest.mark.parametrize("wrong", ["shape", "dtype"])
def test_engine_refuses_redis_entries_of_another_layout(tiny_runner: Any, redis_url: str, wrong: str) -> None:
    import redis

    from prefixcache.cache.tiers import TensorCodec

    off = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    a, (ra,) = _engine(tiny_runner, redis_url=redis_url)
    ids = _prompt(8)
    try:
        _same_as_cache_off(a, off, ids)
        ra.flush()
        ns = a.cache.namespace(a.fingerprint)
        keys = a.cache.block_keys(ids, ns)
        layout = a.block_layout
        codec = TensorCodec.from_secret(SECRET)
        client = redis.Redis.from_url(redis_url)
        name = ra.redis_key(keys[2], ns.root)
        genuine = codec.decode(client.get(name), layout=layout)
        if wrong == "shape":
            bad = torch.zeros(*layout.shape[:-1], layout.shape[-1] + 1)
        else:
            bad = genuine.payload.to(torch.float64)
        client.set(name, codec.encode(keys[2], keys[1], genuine.tokens, bad), keepttl=True)
        b, (rb,) = _engine(tiny_runner, redis_url=redis_url)
        try:
            r = _same_as_cache_off(b, off, ids)
            assert r.usage.cached_tokens == 32  # blocks 0 and 1; block 2 refused
            assert (rb.stats().hits, rb.stats().corrupt) == (2, 1)
        finally:
            b.close()
        a.close()
    finally:
        off.close()


@pytest.mark.model
@pytest.mark.redis
def test_real_model_forged_redis_entries_answer_exactly_as_cache_off(
    real_runner: Any, redis_url: str
) -> None:
    """The issue's reproduction: SmolLM2 writes its blocks to Redis, every entry is zeroed with
    its plain checksum recomputed; a fresh replica reads none and says what cache-off says."""
    import redis

    chunk = 64
    off = Engine(real_runner, prefill_chunk=chunk, enable_cache=False)
    a, (ra,) = _engine(real_runner, chunk=chunk, redis_url=redis_url)
    try:
        system = "You are a meticulous assistant for a logistics company. " * 20
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Where is parcel 42?"}]
        ids = a.render_ids(msgs)
        _same_as_cache_off(a, off, ids)
        ra.flush()
        written = a.cache.stats().blocks
        a.close()
        client = redis.Redis.from_url(redis_url)
        names = redis_entries(client)
        assert len(names) == written >= (len(ids) - 1) // chunk * chunk // 16 > 0
        for name in names:
            client.set(name, forge_zeroed(client.get(name)), keepttl=True)
        b, (rb,) = _engine(real_runner, chunk=chunk, redis_url=redis_url)
        try:
            r = _same_as_cache_off(b, off, ids)
            assert r.usage.cached_tokens == 0
            assert (rb.stats().hits, rb.stats().corrupt) == (0, 1)
        finally:
            b.close()
    finally:
        off.close()
