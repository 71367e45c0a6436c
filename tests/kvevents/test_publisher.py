"""The publisher over a real PrefixCache (no model): every insert, eviction, expiry and flush of
the store arrives as vLLM's events, decoded by a subscriber that knows only vLLM's structs."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from prefixcache.cache import PrefixCache
from prefixcache.cache.clock import FakeClock
from prefixcache.cache.keys import pack_tokens
from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
from prefixcache.kvevents.wire import HashFormat

from .vllm_structs import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, events_of

B = 4  # tokens per block
NBYTES = 100  # bytes per block


def low64(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


@pytest.fixture
def setup() -> Iterator[tuple[PrefixCache, KVEventPublisher, Subscriber, FakeClock]]:
    clock = FakeClock(0.0)
    cache = PrefixCache(block_size=B, capacity_bytes=5 * NBYTES, default_ttl_s=60, clock=clock)
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv"))
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, b"kv")
    yield cache, pub, sub, clock
    sub.close()
    pub.close()


def wait_for(sub: Subscriber, batches: int) -> None:
    """Until batch ``batches - 1`` has arrived (each step below is one batch: the publisher
    thread sends what is queued, and the test waits before the next step)."""
    sub.stream(batches)


def send(cache: PrefixCache, ns, tokens: list[int]) -> list[bytes]:  # noqa: ANN001
    keys = cache.block_keys(tokens, ns)
    cache.replay(ns, keys, pack_tokens(tokens), nbytes=NBYTES)
    return keys


def test_every_store_eviction_expiry_and_flush_arrives_in_order(setup) -> None:  # noqa: ANN001
    cache, pub, sub, clock = setup
    pub.attach(cache)  # (what goes out before the SUB has joined is read from the replay socket)
    wait_for(sub, 1)  # the attach's AllBlocksCleared is a batch of its own: each step waits for its batch
    ns = cache.namespace("fp", "tenant-a", b"secret-salt")
    a = send(cache, ns, list(range(13)))  # 3 full blocks (the 13th token is no block)
    wait_for(sub, 2)
    b = send(cache, ns, [*range(8), 100, 101, 102, 103, 104, 105, 106, 107])  # branch after 2 blocks
    wait_for(sub, 3)
    c = send(cache, ns, [50, 51, 52, 53])  # one block; the budget is 5: the LRU leaf goes
    wait_for(sub, 4)
    clock.advance(61)
    cache.sweep()  # every block expired
    wait_for(sub, 5)
    d = send(cache, ns, [7, 7, 7, 7, 8, 8, 8, 8])
    wait_for(sub, 6)
    assert cache.flush(ns) == 2
    wait_for(sub, 7)

    stream = sub.stream(7)
    events = events_of(stream)
    assert [type(e) for e in events] == [
        AllBlocksCleared,
        BlockStored,
        BlockStored,
        BlockRemoved,
        BlockStored,
        BlockRemoved,
        BlockStored,
        BlockRemoved,
    ]
    _, s1, s2, r1, s3, r2, s4, r3 = events
    assert s1.block_hashes == [low64(k) for k in a] and s1.parent_block_hash is None
    assert s1.token_ids == list(range(12)) and s1.block_size == B and s1.medium == "CPU"
    assert s1.lora_id is None and s1.lora_name is None and s1.extra_keys is None
    assert s2.block_hashes == [low64(k) for k in b[2:]] and s2.parent_block_hash == low64(a[1])
    assert s2.token_ids == [100, 101, 102, 103, 104, 105, 106, 107]
    assert r1.block_hashes == [low64(a[2])]  # capacity: the least recently used leaf
    assert s3.block_hashes == [low64(c[0])] and s3.parent_block_hash is None
    # Expiry takes leaves first, so a chain goes tail first: every block, each once.
    assert sorted(r2.block_hashes) == sorted(low64(k) for k in [a[0], a[1], b[2], b[3], c[0]])
    assert r2.block_hashes.index(low64(b[3])) < r2.block_hashes.index(low64(b[2]))
    assert r2.block_hashes.index(low64(b[2])) < r2.block_hashes.index(low64(a[1]))
    assert s4.block_hashes == [low64(k) for k in d]
    assert r3.block_hashes == [low64(d[1]), low64(d[0])]  # the flush, tail first
    # Sequence numbers 0, 1, 2, ... with no gap; a replay is byte for byte what went out live.
    assert [seq for seq, _ in stream] == list(range(7))
    assert sub.replay(0) == stream
    assert sub.replay(3) == stream[3:] == [r for r in sub.received if r[0] >= 3]
    assert pub.stats.stored_blocks == 8 and pub.stats.removed_blocks == 8 and pub.stats.dropped_events == 0


def test_bytes_hashes_and_salt_never_on_the_wire(setup) -> None:  # noqa: ANN001
    cache, _, _, _ = setup
    config = PublisherConfig(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hash_format=HashFormat.BYTES, medium="GPU"
    )
    pub = KVEventPublisher(config)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.attach(cache)
        salt = b"tenant-secret-salt"
        ns = cache.namespace("fp", "t", salt)
        keys = send(cache, ns, list(range(8)))
        deadline = time.monotonic() + 10
        while not any(isinstance(e, BlockStored) for e in events_of(sub.replay(0))):
            assert time.monotonic() < deadline, "the BlockStored was never published"
            sub.receive(100)  # wait for the publisher thread
        stream = sub.replay(0)
        stored = events_of(stream)[-1]
        assert stored.block_hashes == keys and stored.medium == "GPU"
        assert stored.parent_block_hash is None  # not the namespace root, which mixes in the salt
        assert all(salt not in payload and ns.root not in payload for _, payload in stream)
    finally:
        sub.close()
        pub.close()


def test_a_bad_endpoint_says_what_to_write() -> None:
    with pytest.raises(ValueError, match="tcp://127.0.0.1:5557"):
        KVEventPublisher(PublisherConfig("127.0.0.1:5557"))
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*"))
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(PublisherConfig(pub.endpoint))  # the port is taken
    finally:
        pub.close()


def test_a_closed_publishers_ports_are_free_when_close_returns() -> None:
    """ZeroMQ releases a closed socket's address later, on its I/O thread; the publisher's close
    waits for that, so a restart in the same process binds the same ports at once (a suite's run
    once failed there with 'Address already in use')."""
    import socket

    for _ in range(20):
        pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
        assert pub.replay_endpoint is not None
        ports = [int(e.rsplit(":", 1)[1]) for e in (pub.endpoint, pub.replay_endpoint)]
        pub.close()
        for port in ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))  # OSError while ZeroMQ still holds it


def test_blocks_promoted_from_the_disk_tier_are_stored_again(tiny_runner, tmp_path) -> None:  # noqa: ANN001
    from prefixcache.cache.tiers import attach_tiers, flush_tiers
    from prefixcache.engine.engine import Engine

    cache = PrefixCache(block_size=16)
    attach_tiers(cache, disk_dir=tmp_path / "disk")
    engine = Engine(tiny_runner, prefill_chunk=16, cache=cache)
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.attach(cache)
        ids = list(range(3, 53))  # 50 tokens: 3 full blocks
        keys = cache.block_keys(ids, engine.namespace())
        engine.generate(prompt_token_ids=ids, max_tokens=1)
        flush_tiers(cache)  # the disk tier has every block
        assert cache.flush(engine.namespace()) == 3  # memory only
        again = engine.generate(prompt_token_ids=ids, max_tokens=1)
        assert again.usage.cached_tokens == 48  # read back from disk
        want = [low64(k) for k in keys]
        deadline = time.monotonic() + 10
        while sum(len(e.block_hashes) for e in events_of(sub.replay(0)) if isinstance(e, BlockStored)) < 6:
            assert time.monotonic() < deadline, "the promotion's BlockStored never came"
            sub.receive(100)
        events = events_of(sub.replay(0))
        assert isinstance(events[0], AllBlocksCleared)
        cut = next(i for i, e in enumerate(events) if isinstance(e, BlockRemoved))
        committed, flushed, promoted = events[1:cut], events[cut], events[cut + 1 :]
        # The engine commits chunk by chunk (16 tokens), so the commit may come as several events.
        assert all(isinstance(e, BlockStored) for e in committed + promoted)
        assert [h for e in committed for h in e.block_hashes] == want
        assert flushed.block_hashes == want[::-1]
        assert [h for e in promoted for h in e.block_hashes] == want
        assert [t for e in promoted for t in e.token_ids] == ids[:48]
        assert promoted[0].parent_block_hash is None
    finally:
        sub.close()
        pub.close()
        engine.close()
