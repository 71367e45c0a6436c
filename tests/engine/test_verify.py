"""The live exactness audit (engine/serving/verify.py): a hit recomputed with the cache bypassed.

Each injected fault (a flipped bit in a cached pool block, a disk entry with wrong KV under a valid
MAC, an attention kernel made non-invariant on purpose) is caught, the blocks concerned are
removed, and the next request recomputes and answers exactly as the cache off.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixcache.cache import PrefixCache
from prefixcache.cache.tiers import DiskTier, TensorCodec, flush_tiers
from prefixcache.engine.engine import Engine
from prefixcache.engine.llama import LlamaRunner
from prefixcache.engine.serving.verify import Auditor


def _ids(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _cold(runner: Any, ids: list[int], chunk: int = 16) -> torch.Tensor:
    off = Engine(runner, prefill_chunk=chunk, enable_cache=False)
    try:
        return off.generate(prompt_token_ids=ids, max_tokens=4, return_logits=True)
    finally:
        off.close()


def _wait_counts(auditor: Auditor, total: int, timeout: float = 60.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = auditor.counts()
        if sum(counts.values()) >= total:
            return counts
        time.sleep(0.02)
    raise AssertionError(f"the audit did not finish {total} checks: {auditor.counts()}")


def test_sampled_hits_of_an_honest_cache_are_equal(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16, verify_rate=1.0)
    try:
        ids = _ids(1)
        engine.generate(prompt_token_ids=ids, max_tokens=3)  # a miss: nothing to check
        for extra in ([7], [8, 9], [10]):  # hits of 3 blocks, with different tails
            engine.generate(prompt_token_ids=ids + extra, max_tokens=3)
        assert _wait_counts(engine.auditor, 3) == {"equal": 3, "differ": 0, "skipped": 0}
        assert not engine.auditor.degraded
        assert engine.verify(prompt_token_ids=ids).result == "equal"
        assert engine.verify(prompt_token_ids=_ids(2)).result == "not_cached"
    finally:
        engine.close()


def test_rate_zero_checks_nothing_and_a_rate_samples_about_that_share(tiny_runner: Any) -> None:
    off = Engine(tiny_runner, prefill_chunk=16, verify_rate=0.0)
    try:
        ids = _ids(3, 40)
        for i in range(4):
            off.generate(prompt_token_ids=ids + [i], max_tokens=1)
        assert off.auditor.counts() == {"equal": 0, "differ": 0, "skipped": 0}
        assert not off.auditor.busy
    finally:
        off.close()
    with pytest.raises(ValueError, match="verify rate"):
        Auditor(1.5)


def test_a_flipped_bit_in_a_cached_pool_block_is_caught_and_the_next_request_is_exact(
    tiny_runner: Any,
) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16, verify_rate=0.0)
    try:
        ids = _ids(4)
        engine.generate(prompt_token_ids=ids, max_tokens=2)
        ns = engine.namespace()
        keys = engine.cache.block_keys(ids, ns)
        block = engine.cache.snapshots(keys)[1].payload  # the pool block holding positions 16..31
        bits = engine.pool.data[2 % engine.runner.num_layers, 1, 0, block.index, 5]
        width = {2: torch.int16, 4: torch.int32}[bits.element_size()]
        bits.view(width)[3] ^= 1  # one bit of one value at position 16 + 5

        result = engine.verify(prompt_token_ids=ids)
        assert result.result == "differ"
        diff = result.difference
        assert (diff.block, diff.position, diff.kv_equal) == (1, 21, False)
        assert diff.removed_blocks >= 2  # block 1 and the one after it (the run holding them)
        assert engine.cache.snapshots(keys[1:], missing_ok=True) == []
        assert engine.auditor.degraded and engine.auditor.counts()["differ"] == 1

        again = engine.generate(prompt_token_ids=ids, max_tokens=4, return_logits=True)
        cold = _cold(tiny_runner, ids)
        assert again.usage.cached_tokens <= 16  # block 0 was right: it may stay
        assert torch.equal(again.first_logits, cold.first_logits) and again.tokens == cold.tokens
        assert engine.verify(prompt_token_ids=ids).result == "equal"  # recomputed blocks are right
        assert engine.auditor.acknowledge() == 1 and not engine.auditor.degraded
    finally:
        engine.close()


def test_a_disk_entry_with_wrong_kv_under_a_valid_mac_is_caught_and_removed(
    tiny_runner: Any, tmp_path: Path
) -> None:
    codec = TensorCodec.from_secret("audit-secret")

    def engine_over_disk() -> tuple[Engine, DiskTier]:
        cache = PrefixCache(block_size=16)
        disk = DiskTier(tmp_path, codec=codec)
        cache.add_tier(disk)
        return Engine(tiny_runner, prefill_chunk=16, cache=cache, verify_rate=1.0), disk

    ids = _ids(5)
    a, disk_a = engine_over_disk()
    a.generate(prompt_token_ids=ids, max_tokens=2)
    flush_tiers(a.cache)
    ns = a.namespace()
    keys = a.cache.block_keys(ids, ns)
    a.close()
    # A buggy writer with the right key: block 2's entry holds other KV, with a valid MAC.
    path = disk_a.path_of(bytes(keys[2]), ns.root)
    entry = codec.decode(path.read_bytes(), layout=a.block_layout)
    wrong = entry.payload.clone()
    wrong[0, 0, 0, 3, 1] += 1.0
    path.write_bytes(codec.encode(bytes(keys[2]), bytes(keys[1]), entry.tokens, wrong))

    b, disk_b = engine_over_disk()
    try:
        hit = b.generate(prompt_token_ids=ids, max_tokens=2)
        assert hit.usage.cached_tokens == 48 and disk_b.stats().corrupt == 0  # served: the MAC holds
        counts = _wait_counts(b.auditor, 1)
        assert counts["differ"] == 1
        diff = b.auditor.differences[0]
        assert (diff.block, diff.position) == (2, 35)
        assert diff.tier_entries_removed == {"disk": 1}
        assert not path.exists()

        again = b.generate(prompt_token_ids=ids, max_tokens=4, return_logits=True)
        cold = _cold(tiny_runner, ids)
        assert again.usage.cached_tokens == 32  # blocks 0 and 1, still right on disk
        assert torch.equal(again.first_logits, cold.first_logits) and again.tokens == cold.tokens
    finally:
        b.close()


class _ChunkDependentAttention(LlamaRunner):
    """The torch attention, scaled when a call has more than 400 query rows: a kernel whose bits
    depend on the chunk a row is computed in, as a split chosen by the query length would be
    (torch's SDPA is that on some CPUs and not on others, so it cannot be the control here)."""

    def _attend(self, q: Any, plan: Any, kp: Any, vp: Any) -> Any:
        out = super()._attend(q, plan, kp, vp)
        return out * 1.01 if plan.rows.numel() > 400 else out


def test_a_kernel_made_non_invariant_on_purpose_is_caught(tiny_runner: Any) -> None:
    sdpa = _ChunkDependentAttention(tiny_runner, kernels="torch")
    engine = Engine(sdpa, prefill_chunk=512, verify_rate=1.0)
    try:
        ids = _ids(6, 700)
        engine.generate(prompt_token_ids=ids[:300], max_tokens=1)  # one 300-row chunk
        hit = engine.generate(prompt_token_ids=ids, max_tokens=1)  # 288 cached, then 412 rows
        assert hit.usage.cached_tokens == 288
        counts = _wait_counts(engine.auditor, 1)
        assert counts["differ"] == 1 and engine.auditor.degraded  # recomputed as 512 + 188 rows

        again = engine.generate(prompt_token_ids=ids, max_tokens=4, return_logits=True)
        assert again.usage.cached_tokens == 0
        cold = _cold(sdpa, ids, chunk=512)
        assert torch.equal(again.first_logits, cold.first_logits) and again.tokens == cold.tokens
    finally:
        engine.close()


def test_checks_run_beside_running_requests_and_never_fail_them(tiny_runner: Any) -> None:
    import threading

    engine = Engine(tiny_runner, prefill_chunk=32, verify_rate=1.0)
    cold_engine = Engine(tiny_runner, prefill_chunk=32, enable_cache=False)
    try:
        base = _ids(7, 48)
        engine.generate(prompt_token_ids=base, max_tokens=1)
        prompts = [base + [20 + i] * (i + 1) for i in range(6)]
        out: list[Any] = [None] * len(prompts)

        def call(i: int) -> None:
            out[i] = engine.generate(prompt_token_ids=prompts[i], max_tokens=12, return_logits=True)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for ids, got in zip(prompts, out, strict=True):
            want = cold_engine.generate(prompt_token_ids=ids, max_tokens=12, return_logits=True)
            assert torch.equal(got.first_logits, want.first_logits) and got.tokens == want.tokens
        counts = _wait_counts(engine.auditor, 6)
        assert counts["differ"] == 0 and counts["equal"] + counts["skipped"] == 6 and counts["equal"] >= 1
        assert engine.worker_stats().reserved_blocks == 0
    finally:
        engine.close()
        cold_engine.close()


@pytest.mark.model
def test_real_model_audit_agrees_with_a_cold_run_and_catches_a_flipped_bit(real_runner: Any) -> None:
    """The audit's verdict on a real hit is what comparing it with a cold engine says (equal where
    the machine's GEMMs keep the runner row-invariant: docs/engine.md), and a flipped bit in the
    first cached block is caught, after which the prompt is recomputed exactly."""
    engine = Engine(real_runner, verify_rate=1.0)
    cold = Engine(real_runner, enable_cache=False)
    try:
        system = "You are a careful assistant. Answer in one short sentence. " * 3
        first = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
        second = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
        engine.generate(messages=first, max_tokens=2)
        hit = engine.generate(messages=second, max_tokens=2, return_logits=True)
        assert hit.usage.cached_tokens >= 32
        want = cold.generate(messages=second, max_tokens=2, return_logits=True)
        counts = _wait_counts(engine.auditor, 1)
        exact = torch.equal(hit.first_logits, want.first_logits)
        assert counts == {"equal": int(exact), "differ": int(not exact), "skipped": 0}
        engine.auditor.acknowledge()

        engine.generate(messages=second, max_tokens=1)  # cached again (whatever the verdict)
        # That hit is audited too (rate 1): let its check finish before a bit is flipped under it,
        # or the background check finds the flip first and removes the blocks verify() should read.
        counts = _wait_counts(engine.auditor, 2)
        assert counts["skipped"] == 0 and (counts["equal"] == 2 or not exact)
        engine.auditor.acknowledge()
        ids = engine.prompt_ids(messages=second)
        block = engine.cache.snapshots(engine.cache.block_keys(ids, engine.namespace())[:1])[0].payload
        bits = engine.pool.data[7, 0, 1, block.index, 9]
        bits.view({2: torch.int16, 4: torch.int32}[bits.element_size()])[11] ^= 1 << 3
        result = engine.verify(messages=second)
        assert result.result == "differ" and result.difference.block == 0
        assert result.difference.position <= 9  # the flipped position, or an earlier difference
        assert engine.auditor.degraded
        again = engine.generate(messages=second, max_tokens=6, return_logits=True)
        want = cold.generate(messages=second, max_tokens=6, return_logits=True)
        assert again.usage.cached_tokens == 0  # every block from block 0 on is gone: a cold run
        assert torch.equal(again.first_logits, want.first_logits) and again.text == want.text
    finally:
        engine.close()
        cold.close()
