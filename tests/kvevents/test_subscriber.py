"""The router's subscriber (:class:`EventFeed`) against the publisher: a feed that starts late
rebuilds the stream from the replay socket, in order; one that starts after the replay buffer
rolled over reports the lost range and its replica view is not trusted as complete."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from prefixcache.cache import PrefixCache
from prefixcache.cache.keys import pack_tokens
from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
from prefixcache.kvevents.subscriber import EventFeed
from prefixcache.kvevents.wire import AllBlocksCleared, BlockStored, KVEventBatch
from prefixcache.router.kv_index import ReplicaBlocks


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def publish(cache: PrefixCache, pub: KVEventPublisher, prompts: int, first: int = 0) -> list[int]:
    """``prompts`` new one-block prompts (numbered from ``first``), each its own batch (waits for
    each to go out). Returns their hashes."""
    ns = cache.namespace("fp", "t", b"salt")
    out = []
    for i in range(first, first + prompts):
        tokens = [i, i, i, i]
        key = cache.block_keys(tokens, ns)[0]
        before = pub.stats.batches
        cache.replay(ns, [key], pack_tokens(tokens), nbytes=1)
        until(lambda before=before: pub.stats.batches > before, f"batch of prompt {i}")
        out.append(int.from_bytes(key[-8:], "big"))
    return out


def test_a_late_feed_rebuilds_the_stream_from_replay_then_follows_live() -> None:
    cache = PrefixCache(block_size=4)
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    got: list[tuple[int, KVEventBatch]] = []
    view, lost = ReplicaBlocks(), []
    try:
        pub.attach(cache)
        until(lambda: pub.stats.batches == 1, "AllBlocksCleared")
        hashes = publish(cache, pub, 3)

        def on_batch(seq: int, batch: KVEventBatch) -> None:
            got.append((seq, batch))
            view.apply(seq, batch, time.monotonic())

        feed = EventFeed(pub.endpoint, pub.replay_endpoint, on_batch=on_batch, on_lost=lost.append).start()
        try:
            until(lambda: feed.stats.last_seq == 3, "the replayed history")
            assert [seq for seq, _ in got] == [0, 1, 2, 3] and feed.stats.replayed == 4
            assert isinstance(got[0][1].events[0], AllBlocksCleared)
            assert view.synced and view.held == set(hashes)
            hashes += publish(cache, pub, 1, first=3)  # live now
            until(lambda: feed.stats.last_seq == 4, "the live batch")
            assert [seq for seq, _ in got] == [0, 1, 2, 3, 4] and feed.stats.replayed == 4
            assert isinstance(got[-1][1].events[0], BlockStored) and view.held == set(hashes)
            assert lost == [] and feed.stats.gaps == 0
        finally:
            feed.close()
    finally:
        pub.close()


def test_history_older_than_the_buffer_is_reported_lost_and_the_view_not_synced() -> None:
    cache = PrefixCache(block_size=4)
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2))
    view, lost, seqs = ReplicaBlocks(), [], []
    try:
        pub.attach(cache)
        until(lambda: pub.stats.batches == 1, "AllBlocksCleared")
        hashes = publish(cache, pub, 4)  # batches 1..4; the buffer keeps 3 and 4

        def on_batch(seq: int, batch: KVEventBatch) -> None:
            seqs.append(seq)
            view.apply(seq, batch, time.monotonic())

        feed = EventFeed(pub.endpoint, pub.replay_endpoint, on_batch=on_batch, on_lost=lost.append).start()
        try:
            until(lambda: feed.stats.last_seq == 4, "the replayed tail")
            assert seqs == [3, 4] and len(lost) == 1 and "0..2" in lost[0]
            assert not view.synced and view.held == set(hashes[2:])
        finally:
            feed.close()
    finally:
        pub.close()


def test_a_restarted_publisher_is_followed_from_its_new_start() -> None:
    from prefixcache.commands.cluster import free_port

    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    view, lost = ReplicaBlocks(), []
    cache = PrefixCache(block_size=4)
    first = zmq.Context()  # its own, terminated below: the ports are free when term() returns
    pub = KVEventPublisher(PublisherConfig(endpoint, replay), context=first)
    feed = EventFeed(
        endpoint, replay, on_batch=lambda seq, b: view.apply(seq, b, time.monotonic()), on_lost=lost.append
    ).start()
    try:
        pub.attach(cache)
        until(lambda: pub.stats.batches == 1, "AllBlocksCleared")
        old = publish(cache, pub, 3)
        until(lambda: feed.stats.last_seq == 3, "the first publisher's batches")
        assert view.held == set(old) and view.synced
        pub.close()
        first.term()
        cache = PrefixCache(block_size=4)  # a new process: empty cache, sequence from 0
        pub = KVEventPublisher(PublisherConfig(endpoint, replay))
        pub.attach(cache)
        until(lambda: pub.stats.batches == 1, "the new AllBlocksCleared")
        new = publish(cache, pub, 1, first=7)
        until(lambda: view.held == set(new), "the restarted publisher's stream")
        assert view.synced and feed.stats.restarts == 1 and len(lost) == 1 and "restarted" in lost[0]
        assert feed.stats.last_seq == 1
    finally:
        feed.close()
        pub.close()


def test_events_dropped_on_a_full_queue_leave_a_gap_every_subscriber_sees() -> None:
    from prefixcache.router.kv_index import FeedSpec, KVIndex

    cache = PrefixCache(block_size=4)
    pub = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", max_queue=2))
    index = KVIndex({"http://r": FeedSpec(pub.endpoint, pub.replay_endpoint)}, chunk_chars=256)
    try:
        pub.attach(cache, start=False)  # the queue holds AllBlocksCleared; nothing drains it yet
        ns = cache.namespace("fp", "t", b"salt")
        tokens = list(range(12))  # three blocks: the first fits in the queue, two are dropped
        cache.replay(ns, cache.block_keys(tokens, ns), pack_tokens(tokens), nbytes=1)
        assert pub.stats.dropped_events == 2
        # publish batch 0 before the feed starts, so the feed's catch-up from 0 on connecting
        # replays it (a live copy sent while the subscription is still joining would be lost)
        pub.start()
        until(lambda: pub.stats.batches == 1, "batch 0 published")
        index.start()
        until(lambda: index.snapshot()["http://r"]["last_seq"] == 0, "the batch before the drops")
        assert (
            index.snapshot()["http://r"] | {"synced": True, "blocks": 1, "lost": 0}
            == index.snapshot()["http://r"]
        )
        publish(cache, pub, 1, first=20)  # the next event: numbered after a gap of two
        until(lambda: index.snapshot()["http://r"]["last_seq"] == 3, "the batch after the gap")
        row = index.snapshot()["http://r"]
        assert row["batches"] == 2 and row["lost"] == 1 and row["gaps"] == 1
        assert not row["synced"]  # its view misses the two dropped blocks: the record decides again
        assert pub.stats.stored_blocks == 2 and pub.stats.dropped_events == 2
    finally:
        index.close()
        pub.close()
