"""A subscriber to one publisher's KV event stream (vLLM's protocol, see :mod:`.wire`), in order
and without gaps where the replay socket can fill them.

    feed = EventFeed("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", on_batch=index.apply)
    feed.start()   # a daemon thread: SUB (and a DEALER for replays)
    ...
    feed.close()

The thread connects the SUB socket first, then asks the replay socket for everything from
sequence 0, so a subscriber that starts after the publisher rebuilds the stream's history (as far
as the publisher's buffer reaches). Each batch then goes to ``on_batch(seq, batch)`` exactly once,
in sequence order. A batch whose sequence number jumps ahead triggers a replay of the missing
range; a range the replay cannot fill (older than the publisher's buffer, dropped by the
publisher, or no replay socket) is reported through ``on_lost(reason)`` before the stream goes on
(the consumer's view of the publisher is then incomplete until it sees ``AllBlocksCleared``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from prefixcache.kvevents.wire import END_SEQ, KVEventBatch, decoder

log = logging.getLogger(__name__)

_END = int.from_bytes(END_SEQ, "big", signed=True)


@dataclass(slots=True)
class FeedStats:
    batches: int = 0  # applied, live or replayed
    replayed: int = 0  # of which from the replay socket
    gaps: int = 0  # jumps in the live sequence
    lost: int = 0  # ranges no replay could fill
    undecodable: int = 0
    last_seq: int = -1


class EventFeed:
    """One publisher's stream, applied in order by a daemon thread (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        on_batch: Callable[[int, KVEventBatch], None],
        on_lost: Callable[[str], None] | None = None,
        replay_timeout_s: float = 1.0,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.on_batch = on_batch
        self.on_lost = on_lost or (lambda reason: None)
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.stats = FeedStats()
        self._ctx = context or zmq.Context.instance()
        self._decode = decoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> EventFeed:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        replay = None
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = self._replay_socket()
                replay = self._catch_up(replay, 0, None)
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.undecodable += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                last = self.stats.last_seq
                if seq <= last:
                    continue  # already applied from a replay
                if seq > last + 1:
                    self.stats.gaps += 1
                    if replay is not None:
                        replay = self._catch_up(replay, last + 1, seq)
                    if self.stats.last_seq < seq - 1:
                        self._lost(f"batches {self.stats.last_seq + 1}..{seq - 1} missed and not replayed")
                self._apply(seq, frames[2], replayed=False)
        except zmq.ZMQError:
            if not self._stop.is_set():
                log.exception("kv events: the feed from %s failed", self.endpoint)
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _replay_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        assert self.replay_endpoint is not None
        sock.connect(self.replay_endpoint)
        return sock

    def _catch_up(self, sock: zmq.Socket, start: int, before: int | None) -> zmq.Socket:
        """Ask for every batch from ``start`` and apply those below ``before`` (None: all) that
        continue the sequence. Returns the socket to use next (a fresh one after a timeout, so a
        late answer is never read as the next one's)."""
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            if not sock.poll(self.replay_timeout_ms):
                log.warning("kv events: no replay answer from %s", self.replay_endpoint)
                sock.close(linger=0)
                return self._replay_socket()
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the DEALER's empty delimiter
            if len(frames) == 3:
                frames = frames[1:]  # [topic, seq, payload] (vLLM >= 0.26); older: [seq, payload]
            if len(frames) != 2 or len(frames[0]) != 8:
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == _END or not frames[1]:
                return sock
            last = self.stats.last_seq
            if seq == last + 1 and (before is None or seq < before):
                self._apply(seq, frames[1], replayed=True)
            elif seq > last + 1 and (before is None or seq < before):
                self._lost(f"batches {last + 1}..{seq - 1} are no longer in the publisher's buffer")
                self._apply(seq, frames[1], replayed=True)

    def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self.stats.last_seq = seq
        try:
            batch = self._decode.decode(payload)
        except msgspec.DecodeError as e:  # (ValidationError is a DecodeError)
            self.stats.undecodable += 1
            self._lost(f"batch {seq} could not be decoded: {e}")
            return
        self.stats.batches += 1
        self.stats.replayed += int(replayed)
        try:
            self.on_batch(seq, batch)
        except Exception:  # the consumer's bug must not stop the feed
            log.exception("kv events: applying batch %d failed", seq)

    def _lost(self, reason: str) -> None:
        self.stats.lost += 1
        log.warning("kv events from %s: %s", self.endpoint, reason)
        self.on_lost(reason)
