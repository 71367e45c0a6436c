"""Publishes the cache's block events over ZeroMQ in vLLM's KV event format (see :mod:`.wire`).

    publisher = KVEventPublisher(PublisherConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"))
    publisher.attach(engine.cache)     # AllBlocksCleared, then every insert and removal
    ...
    publisher.close()

What is published, from the store's listener (:meth:`BlockStore.add_listener`):

* ``BlockStored`` when blocks enter memory: committed by a request, or promoted from a disk or
  Redis tier; consecutive blocks of one chain go out as one event (parent first);
* ``BlockRemoved`` when they leave it: evicted for room (``capacity``), expired (``ttl``) or
  flushed (``DELETE /v1/cache``);
* ``AllBlocksCleared`` once, first, when the publisher is attached (a subscriber that sees it
  knows its view of this replica starts empty).

The listener runs under the cache's lock, so it only appends the block's key, parent and packed
tokens to a bounded queue (never blocking: when the queue is full the event is dropped and
counted, and the sequence numbers skip one where it would have gone, so that every subscriber sees
a gap that no replay can fill, at the next batch). A publisher thread coalesces what is queued
into one batch, encodes it and sends it on a PUB socket (which drops, never blocks, for a
subscriber past its high-water mark), keeping the last ``buffer_steps`` batches for replay.

Hashes: a block's key is the chained SHA-256 of :mod:`prefixcache.cache.keys` under the tenant's
namespace; on the wire it is its low 64 bits (``int``, vLLM's default) or the whole key
(``bytes``). A first block's parent is None, never the namespace root: the root mixes in the
tenant's salt, which stays in the server.

Protection (see :mod:`.security`): optional CURVE on both sockets (only the client keys given
may connect); a replay request gets at most ``replay_max_batches`` batches, and at most
``replay_per_s`` requests a second are served (beyond, an empty answer, counted), so replays
cannot starve live publishing; a subscriber or replay client may send us nothing larger than
``max_request_bytes``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from prefixcache.cache.blocks import Block
from prefixcache.cache.keys import unpack_tokens
from prefixcache.kvevents.security import CurveServer
from prefixcache.kvevents.wire import (
    END_SEQ,
    MEDIUM_CPU,
    REPLAY_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashFormat,
    KVEventBatch,
    encoder,
    external_hash,
)

log = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(slots=True)
class PublisherConfig:
    """Where and how to publish (``prefixcache serve --kv-events-*``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages per subscriber)
    max_queue: int = 100_000  # block events waiting for the publisher thread
    hash_format: HashFormat = HashFormat.INT
    medium: str = MEDIUM_CPU
    #: CURVE: the publisher's Z85 secret key and the client public keys it admits (None: plain)
    curve_secret: bytes | None = None
    curve_clients: frozenset[bytes] = frozenset()
    replay_max_batches: int = REPLAY_WINDOW  # batches one replay request gets at most (oldest first)
    replay_per_s: float = 20.0  # replay requests served per second (a burst of as many); beyond: empty
    max_request_bytes: int = 1_024  # the largest message a subscriber or replay client may send us


@dataclass(slots=True)
class PublisherStats:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    dropped_events: int = 0
    replay_requests: int = 0
    replay_refused: int = 0  # over the replay rate: answered with an empty replay


def check_endpoint(endpoint: str, flag: str) -> None:
    """ValueError with a fix unless ``endpoint`` is a ZeroMQ address the publisher can bind."""
    if not endpoint.startswith(_SCHEMES):
        raise ValueError(
            f"{flag} '{endpoint}' is not a ZeroMQ address; write e.g. tcp://127.0.0.1:5557 "
            "(tcp://, ipc:// or inproc://)"
        )


class KVEventPublisher:
    """One PUB socket (and optionally one ROUTER replay socket), bound at construction, fed by
    :meth:`listener` and drained by a daemon thread (started by :meth:`attach` or :meth:`start`).
    Thread-safe: ``listener`` may be called from any thread; the sockets are only used by the
    publisher thread once it runs."""

    def __init__(self, config: PublisherConfig, *, context: zmq.Context | None = None) -> None:
        check_endpoint(config.endpoint, "--kv-events-endpoint")
        if config.replay_endpoint is not None:
            check_endpoint(config.replay_endpoint, "--kv-events-replay-endpoint")
        self.config = config
        self.stats = PublisherStats()
        self._curve: CurveServer | None = None
        self._own_ctx: zmq.Context | None = None
        if config.curve_secret is not None:
            if not config.curve_clients:
                raise ValueError(
                    "CURVE needs the public keys of the clients it admits (--kv-events-curve-clients)"
                )
            # Its own context: the ZAP handler then governs these sockets only.
            self._own_ctx = context = zmq.Context()
            self._curve = CurveServer(context, config.curve_secret, config.curve_clients)
        elif context is None and not config.endpoint.startswith("inproc://"):
            # Its own context too, terminated by close(): ZeroMQ releases a closed socket's
            # address later, on its I/O thread, and term() waits for that, so the ports are
            # free when close() returns (a restart in the same process can bind them again).
            # inproc:// peers must share a context: those use the process's.
            self._own_ctx = context = zmq.Context()
        self._ctx = context or zmq.Context.instance()
        self._allowance = float(config.replay_per_s)
        self._allowance_at = time.monotonic()
        self._queue: queue.Queue[tuple[int, tuple[Any, ...]]] = queue.Queue(maxsize=config.max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self._puts = itertools.count()  # each queued event's index
        self._drops: deque[int] = deque()  # indices of events dropped on a full queue
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.MAXMSGSIZE, config.max_request_bytes)  # subscriptions only
            if self._curve is not None:
                self._curve.secure(self._pub)
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, config.max_request_bytes)
                if self._curve is not None:
                    self._curve.secure(self._replay)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV event sockets ({config.endpoint}): {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self._running = True
        self._started = False
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)

    # ------------------------------------------------------------------ the cache side
    def attach(self, cache: Any, *, start: bool = True) -> None:
        """Announce an empty view (``AllBlocksCleared``), then publish every insert and removal
        of ``cache`` (a :class:`~prefixcache.cache.PrefixCache`). Attach before traffic.
        ``start``: start publishing now (else :meth:`start` does; events queue meanwhile)."""
        self._put(("clear",))
        cache.store.add_listener(self.listener)
        if start:
            self.start()

    def start(self) -> None:
        """Start the publisher thread (once)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def listener(self, event: str, block: Block) -> None:
        """The store's listener: O(1), never blocks (see the module docstring)."""
        if event == "insert":
            self._put(("store", block.key, block.parent, block.tokens))
        elif event == "evict":
            self._put(("remove", block.key))

    def _put(self, item: tuple[Any, ...]) -> None:
        index = next(self._puts)  # (atomic under the GIL)
        try:
            self._queue.put_nowait((index, item))
        except queue.Full:
            self._drops.append(index)  # the gap goes where the event would have been
            self.stats.dropped_events += 1

    # ------------------------------------------------------------------ the publisher thread
    def _run(self) -> None:
        pack = encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError:
                    log.exception("kv events: a replay request failed")
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            items = [first]
            with contextlib.suppress(queue.Empty):
                while len(items) < 4096:
                    items.append(self._queue.get_nowait())
            run: list[tuple[Any, ...]] = []
            for index, item in items:
                skipped = 0
                while self._drops and self._drops[0] < index:  # events were dropped before this one
                    self._drops.popleft()
                    skipped += 1
                if skipped:
                    self._publish(pack, run)
                    run = []
                    self._seq += skipped  # a gap in the numbers that no replay can fill
                run.append(item)
            self._publish(pack, run)
        with contextlib.suppress(zmq.ZMQError):
            while self._replay is not None and self._replay.poll(0):
                self._serve_replay()

    def _events(self, items: list[tuple[Any, ...]]) -> list[Any]:
        """Queued items as events, consecutive stores of one chain (and consecutive removals)
        merged into one event each."""
        fmt, medium, block_size = self.config.hash_format, self.config.medium, 0
        events: list[Any] = []
        last_key: bytes | None = None  # the last stored key of events[-1] when it is a BlockStored
        for item in items:
            kind = item[0]
            if kind == "store":
                _, key, parent, tokens = item
                ids = unpack_tokens(tokens)
                block_size = len(ids)
                prev = events[-1] if events else None
                if (
                    isinstance(prev, BlockStored)
                    and parent is not None
                    and parent == last_key
                    and prev.block_size == block_size
                ):
                    prev.block_hashes.append(external_hash(key, fmt))
                    prev.token_ids.extend(ids)
                else:
                    events.append(
                        BlockStored(
                            block_hashes=[external_hash(key, fmt)],
                            parent_block_hash=None if parent is None else external_hash(parent, fmt),
                            token_ids=ids,
                            block_size=block_size,
                            lora_id=None,
                            medium=medium,
                            lora_name=None,
                        )
                    )
                last_key = key
                self.stats.stored_blocks += 1
            elif kind == "remove":
                prev = events[-1] if events else None
                if isinstance(prev, BlockRemoved):
                    prev.block_hashes.append(external_hash(item[1], fmt))
                else:
                    events.append(BlockRemoved(block_hashes=[external_hash(item[1], fmt)], medium=medium))
                last_key = None
                self.stats.removed_blocks += 1
            else:
                events.append(AllBlocksCleared())
                last_key = None
                self.stats.cleared += 1
        return events

    def _publish(self, pack: Any, items: list[tuple[Any, ...]]) -> None:
        events = self._events(items)
        if events:
            self._send(pack.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # (a PUB socket drops rather than block; kept for other socket types)
            pass
        except zmq.ZMQError:
            log.exception("kv events: publishing batch %d failed", seq)
        self._buffer.append((seq, payload))
        self.stats.batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        self.stats.replay_requests += 1
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        if self._take_allowance():
            sent = 0
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                    sent += 1
                    if sent >= self.config.replay_max_batches:
                        break  # the client asks again from where this ended
        else:
            self.stats.replay_refused += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _take_allowance(self) -> bool:
        """A token bucket of ``replay_per_s`` requests a second (a burst of as many)."""
        rate = self.config.replay_per_s
        now = time.monotonic()
        self._allowance = min(rate, self._allowance + (now - self._allowance_at) * rate)
        self._allowance_at = now
        if self._allowance < 1.0:
            return False
        self._allowance -= 1.0
        return True

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued (up to ``timeout_s``), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._curve is not None:
            self._curve.close()
            self._curve = None
        if self._own_ctx is not None:
            self._own_ctx.term()
            self._own_ctx = None

    def metrics(self) -> list[Any]:
        """Prometheus metric families (for a collector on the server's registry)."""
        from prometheus_client.core import CounterMetricFamily

        s = self.stats
        fams = []
        for name, value, doc in (
            ("batches", s.batches, "KV event batches published."),
            ("stored_blocks", s.stored_blocks, "Blocks announced as stored (BlockStored)."),
            ("removed_blocks", s.removed_blocks, "Blocks announced as removed (BlockRemoved)."),
            ("dropped", s.dropped_events, "Block events dropped because the publish queue was full."),
            ("replay_requests", s.replay_requests, "Replay requests served."),
            ("replay_refused", s.replay_refused, "Replay requests over the replay rate (answered empty)."),
        ):
            fam = CounterMetricFamily(f"prefixcache_kv_events_{name}", doc)
            fam.add_metric([], float(value))
            fams.append(fam)
        return fams
