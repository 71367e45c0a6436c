"""A hostile publisher cannot kill the router's event feed (issue 21, item 4): 1,000 hostile
frames (wrong frame counts, short sequence numbers, garbage, msgpack nested 3,000 deep, wrong
types, frames over the size limit, a batch whose apply raises RecursionError) are each counted as
``undecodable`` and the feed goes on to apply the next good batch; a dead or lagging feed makes
its replica unsynced; a view past its bound starts again empty and unsynced."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from prefixcache.kvevents.subscriber import EventFeed
from prefixcache.kvevents.wire import BlockStored, KVEventBatch, encoder
from prefixcache.router.kv_index import FeedSpec, KVIndex, ReplicaBlocks


def _until(check, what: str, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _batch(hashes: list[int], ts: float | None = None) -> bytes:
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4] * len(hashes),
        block_size=4,
        lora_id=None,
        medium="cpu",
        lora_name=None,
    )
    return encoder().encode(KVEventBatch(ts=time.time() if ts is None else ts, events=[event]))


def _hostile(rng: random.Random, seq: int) -> list[bytes]:
    s = seq.to_bytes(8, "big")
    ts = msgspec.msgpack.encode(time.time())
    choices = [
        [b""],
        [b"", s],
        [b"", s, b"x", b"y"],
        [b"", b"\x00\x01", b"\x90"],
        [b"", s, rng.randbytes(rng.randint(0, 300))],
        [b"", s, b"\x93" + ts + b"\x91" * 3_000 + b"\xc0" + b"\x00"],  # nested 3,000 deep
        [b"", s, b"\x93" + ts + b"\x91\x91" * 1_500 + b"\x00"],
        [b"", s, msgspec.msgpack.encode([time.time(), [["BlockStored", "not-a-list"]], 0])],
        [b"", s, msgspec.msgpack.encode({"ts": "x"})],
        [b"", s, b"\xff" * 70_000],
        [b"", s, b"APPLY-RECURSION"],
    ]
    return rng.choice(choices)


def test_the_feed_is_alive_after_1000_hostile_frames(monkeypatch: pytest.MonkeyPatch):
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KVIndex({"http://r": FeedSpec(f"tcp://127.0.0.1:{port}")}, chunk_chars=256)
    real_apply = index.apply

    def apply(url: str, seq: int, batch: KVEventBatch) -> None:
        if batch.ts == -1.0:  # the marker batch: the consumer blows up in a recursion
            raise RecursionError("maximum recursion depth exceeded")
        real_apply(url, seq, batch)

    monkeypatch.setattr(index, "apply", apply)
    try:
        index.start()
        feed = index.feed("http://r")
        assert feed is not None
        _until(lambda: _probe(pub, index, 0), "the subscription")
        rng = random.Random(21)
        sent = 0
        for seq in range(1, 1_001):
            frames = _hostile(rng, seq)
            if frames[-1] == b"APPLY-RECURSION":
                frames[-1] = _batch([999], ts=-1.0)
            pub.send_multipart(frames)
            sent += 1
        assert sent == 1_000
        pub.send_multipart([b"", (2_000).to_bytes(8, "big"), _batch([4242])])
        _until(lambda: 4242 in index.replicas["http://r"].held, "the good batch after the hostile ones")
        assert feed.alive
        row = index.snapshot()["http://r"]
        assert row["feed_alive"] and row["undecodable"] > 500
        assert not row["synced"]  # hostile frames meant lost batches: the view is not trusted
    finally:
        index.close()
        pub.close()


def _probe(pub: zmq.Socket, index: KVIndex, seq: int) -> bool:
    pub.send_multipart([b"", seq.to_bytes(8, "big"), _batch([1])])
    time.sleep(0.05)
    return 1 in index.replicas["http://r"].held


def test_an_oversized_message_is_dropped_and_the_feed_goes_on():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    got: list[int] = []
    feed = EventFeed(
        f"tcp://127.0.0.1:{port}", on_batch=lambda seq, b: got.append(seq), max_message_bytes=64 << 10
    )
    feed.start()
    try:

        def joined() -> bool:
            pub.send_multipart([b"", (0).to_bytes(8, "big"), _batch([1])])
            time.sleep(0.05)
            return bool(got)

        _until(joined, "the subscription")
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\x00" * (1 << 20)])  # 1 MiB: over the limit
        seqs = iter(range(2, 10_000))

        def after() -> bool:  # ZeroMQ drops the connection that sent it; the SUB reconnects
            pub.send_multipart([b"", next(seqs).to_bytes(8, "big"), _batch([2])])
            time.sleep(0.05)
            return any(s >= 2 for s in got)

        _until(after, "a batch after the oversized one", timeout=30)
        assert feed.alive and 1 not in got and feed.stats.batches >= 2
    finally:
        feed.close()
        pub.close()


def test_a_dead_or_lagging_feed_is_not_trusted():
    index = KVIndex({"http://r": FeedSpec("tcp://127.0.0.1:9")}, chunk_chars=256, max_lag_s=5.0)
    view = index.replicas["http://r"]
    view.apply(0, KVEventBatch(ts=time.time(), events=[]), time.monotonic())
    assert view.synced and index.snapshot()["http://r"]["synced"]
    index.start()
    feed = index.feed("http://r")
    assert feed is not None
    feed.stats.lag_s = 6.0
    assert not index.snapshot()["http://r"]["synced"]  # lagging
    feed.stats.lag_s = 0.0
    assert index.snapshot()["http://r"]["synced"] and index.publishes(["http://r"])
    feed.close()  # the thread ends: a dead feed
    _until(lambda: not feed.alive, "the feed to stop")
    assert not index.snapshot()["http://r"]["synced"] and not index.publishes(["http://r"])
    index.close()


def test_a_view_past_its_bound_starts_again_empty_and_unsynced():
    view = ReplicaBlocks(max_held=10)
    view.apply(0, KVEventBatch(ts=0.0, events=[]), 0.0)
    stored = msgspec.msgpack.decode(_batch(list(range(11))), type=KVEventBatch)
    view.apply(1, stored, 1.0)
    assert view.held == set() and not view.synced and view.overflows == 1
