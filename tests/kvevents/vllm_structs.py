"""A subscriber's view of the stream, written the way vLLM documents it, with no import from
prefixcache: the event structs of ``vllm.distributed.kv_events`` (main after PR 42892: an
array-like batch of tagged-map events; hashes ``int | bytes``), the PUB frames
``[topic, seq (8 bytes big-endian), payload]`` and the ROUTER replay protocol (ask with the start
sequence number, read ``[topic, seq, payload]`` until the ``-1`` end marker)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """SUB on the publisher, DEALER on its replay socket; records ``(seq, payload)`` as received."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.received: list[tuple[int, bytes]] = []

    def receive(self, timeout_ms: int = 5000) -> tuple[int, KVEventBatch] | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        self.received.append((int.from_bytes(seq, "big"), payload))
        return self.received[-1][0], DECODER.decode(payload)

    def stream(self, batches: int, timeout_s: float = 10.0) -> list[tuple[int, bytes]]:
        """Batches 0 .. ``batches - 1``: those read live, the ones missed live (sent before this
        subscriber joined) filled from the replay socket, as a vLLM subscriber does. Fails on a
        gap the replay cannot fill, or when the last batch never comes."""
        deadline = time.monotonic() + timeout_s
        while not self.received or self.received[-1][0] < batches - 1:
            if self.receive(200) is None:
                replayed = dict(self.replay(0))
                if all(seq in replayed for seq in range(batches)):
                    break  # every batch was sent; the last ones before the SUB joined
            assert time.monotonic() < deadline, f"batch {batches - 1} never arrived"
        live = dict(self.received)
        missing = [seq for seq in range(batches) if seq not in live]
        if missing:
            replayed = dict(self.replay(missing[0]))
            for seq in missing:
                live[seq] = replayed[seq]
        return [(seq, live[seq]) for seq in range(batches)]

    def replay(self, start: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
        assert self.replay_endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while sock.poll(timeout_ms):
                _, topic, seq, payload = sock.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert payload == b""
                    return out
                assert topic == self.topic
                out.append((int.from_bytes(seq, "big"), payload))
            raise AssertionError("no end-of-replay marker")
        finally:
            sock.close()

    def close(self) -> None:
        self.sub.close()


def events_of(received: list[tuple[int, bytes]]) -> list[Any]:
    return [ev for _, payload in received for ev in DECODER.decode(payload).events]
