"""The KV event stream's protection (issue 21, item 3): sockets on a non-loopback address are
refused without CURVE or an explicit flag; with CURVE only admitted router keys read the
stream (an anonymous subscriber decodes nothing, where before it read every prompt's token ids);
a replay answers a bounded window at a bounded rate, and a feed catches up window by window."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from prefixcache.cache import PrefixCache
from prefixcache.cache.keys import pack_tokens
from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
from prefixcache.kvevents.security import (
    client_options,
    exposure_refusal,
    is_local,
    read_public_keys,
    read_secret_key,
    write_keypair,
)
from prefixcache.kvevents.subscriber import EventFeed
from prefixcache.kvevents.wire import END_SEQ, BlockStored
from prefixcache.server.build import BuildError, KVEventsConfig, open_publisher

SECRET_IDS = [7731, 42, 9, 1, 2, 3, 4, 5]


def _store(cache: PrefixCache, tokens: list[int]) -> None:
    ns = cache.namespace("fp", "acme", b"salt")
    cache.replay(ns, cache.block_keys(tokens, ns), pack_tokens(tokens), nbytes=100)


def _collect(feed_kwargs: dict, pub: KVEventPublisher, wait_s: float = 3.0) -> list:
    got: list = []
    feed = EventFeed(pub.endpoint, pub.replay_endpoint, on_batch=lambda seq, b: got.append(b), **feed_kwargs)
    feed.start()
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not any(
            isinstance(e, BlockStored) for b in got for e in b.events
        ):
            time.sleep(0.05)
    finally:
        feed.close()
    return [e for b in got for e in b.events if isinstance(e, BlockStored)]


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://*:5557", False),
        ("tcp://10.0.0.5:5557", False),
        ("tcp://eth0:5557", False),
    ],
)
def test_which_endpoints_are_local(endpoint, local):
    assert is_local(endpoint) is local
    refused = exposure_refusal([endpoint], curve=False, allow_unauthenticated=False)
    assert (refused is None) is local
    assert exposure_refusal([endpoint], curve=True, allow_unauthenticated=False) is None
    assert exposure_refusal([endpoint], curve=False, allow_unauthenticated=True) is None


def test_serve_refuses_kv_events_on_all_interfaces_without_curve():
    with pytest.raises(BuildError) as e:
        open_publisher(KVEventsConfig("tcp://0.0.0.0:0", buffer=10))
    assert "Refusing to publish KV events on tcp://0.0.0.0:0" in str(e.value)
    assert e.value.option == "--kv-events-endpoint"
    with pytest.raises(BuildError):  # the replay socket too
        open_publisher(KVEventsConfig("tcp://127.0.0.1:0", "tcp://*:0", buffer=10))
    pub = open_publisher(KVEventsConfig("tcp://0.0.0.0:0", buffer=10, allow_unauthenticated=True))
    assert pub is not None
    pub.close()


def test_key_files(tmp_path: Path):
    key, pub = write_keypair(tmp_path, "publisher")
    assert os.stat(key).st_mode & 0o777 == 0o600
    public, secret = read_secret_key(key)
    assert read_public_keys(pub) == {public} and read_public_keys(tmp_path) == {public}
    os.chmod(key, 0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        read_secret_key(key)
    (tmp_path / "bad.pub").write_text("short\n")
    with pytest.raises(ValueError, match="40 characters"):
        read_public_keys(tmp_path / "bad.pub")


def test_with_curve_only_admitted_keys_read_the_stream(tmp_path: Path):
    pub_key, _ = write_keypair(tmp_path, "publisher")
    router_key, router_pub = write_keypair(tmp_path, "router")
    stranger_key, _ = write_keypair(tmp_path, "stranger")
    public, secret = read_secret_key(pub_key)
    config = PublisherConfig(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        curve_secret=secret,
        curve_clients=read_public_keys(router_pub),
    )
    pub = KVEventPublisher(config)
    cache = PrefixCache(block_size=4, capacity_bytes=10_000, default_ttl_s=60)
    try:
        pub.attach(cache)
        _store(cache, SECRET_IDS)
        time.sleep(0.2)
        assert _collect({}, pub, wait_s=1.5) == []  # anonymous: the handshake fails
        assert _collect({"curve": client_options(public, read_secret_key(stranger_key)[1])}, pub, 1.5) == []
        events = _collect({"curve": client_options(public, read_secret_key(router_key)[1])}, pub)
        assert [list(e.token_ids) for e in events] == [SECRET_IDS]
    finally:
        pub.close()


def test_without_curve_an_anonymous_subscriber_reads_token_ids():
    """The exposure the flags guard against (plain sockets are loopback-only by default)."""
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    cache = PrefixCache(block_size=4, capacity_bytes=10_000, default_ttl_s=60)
    try:
        pub.attach(cache)
        _store(cache, SECRET_IDS)
        assert [list(e.token_ids) for e in _collect({}, pub)] == [SECRET_IDS]
    finally:
        pub.close()


def _replay(endpoint: str, start: int) -> list[int]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        seqs = []
        while True:
            assert sock.poll(3000), "no replay answer"
            frames = sock.recv_multipart()[1:]
            if frames[1] == END_SEQ:
                return seqs
            seqs.append(int.from_bytes(frames[1], "big"))
    finally:
        sock.close()


def _published(pub: KVEventPublisher, cache: PrefixCache, batches: int) -> None:
    """``batches`` batches: AllBlocksCleared, then one store each."""
    pub.attach(cache)
    for i in range(batches):
        if i:
            _store(cache, [1000 + i] * 4)
        deadline = time.monotonic() + 5
        while pub.stats.batches < i + 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)


def test_a_replay_answers_a_bounded_window_at_a_bounded_rate():
    config = PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_max_batches=10, replay_per_s=2)
    pub = KVEventPublisher(config)
    cache = PrefixCache(block_size=4, capacity_bytes=1_000_000, default_ttl_s=60)
    try:
        _published(pub, cache, 30)
        assert _replay(pub.replay_endpoint, 0) == list(range(10))
        assert _replay(pub.replay_endpoint, 25) == list(range(25, 30))
        assert _replay(pub.replay_endpoint, 0) == []  # the burst of 2 is spent
        assert pub.stats.replay_refused == 1
        time.sleep(0.6)  # a token back
        assert _replay(pub.replay_endpoint, 12) == list(range(12, 22))
    finally:
        pub.close()


def test_a_late_feed_catches_up_window_by_window():
    config = PublisherConfig(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_max_batches=7, replay_per_s=1000
    )
    pub = KVEventPublisher(config)
    cache = PrefixCache(block_size=4, capacity_bytes=1_000_000, default_ttl_s=60)
    seqs: list[int] = []
    lost: list[str] = []
    try:
        _published(pub, cache, 40)
        feed = EventFeed(
            pub.endpoint,
            pub.replay_endpoint,
            on_batch=lambda s, b: seqs.append(s),
            on_lost=lost.append,
            replay_window=7,
        )
        feed.start()
        deadline = time.monotonic() + 10
        while len(seqs) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        feed.close()
    finally:
        pub.close()
    assert seqs == list(range(40)) and lost == []
