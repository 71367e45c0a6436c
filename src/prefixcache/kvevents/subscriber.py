"""A subscriber to one publisher's KV event stream (vLLM's protocol, see :mod:`.wire`), in order
and without gaps where the replay socket can fill them.

    feed = EventFeed("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", on_batch=index.apply)
    feed.start()   # a daemon thread: SUB (and a DEALER for replays)
    ...
    feed.close()

Once the SUB socket has connected, the thread asks the replay socket for everything from
sequence 0, so a subscriber that starts after the publisher rebuilds the stream's history (as far
as the publisher's buffer reaches). Each batch then goes to ``on_batch(seq, batch)`` exactly once,
in sequence order. A batch whose sequence number jumps ahead triggers a replay of the missing
range; a range the replay cannot fill (older than the publisher's buffer, dropped by the
publisher, or no replay socket) is reported through ``on_lost(reason)`` before the stream goes on
(the consumer's view of the publisher is then incomplete until it sees ``AllBlocksCleared``). A
publisher that restarts begins again at 0: on every reconnection the feed asks for the last batch
it applied, and when the publisher no longer has it (with the same timestamp), or a known number
arrives live with another batch, the restart is reported the same way and the new stream is
followed from its start (replayed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from prefixcache.kvevents.wire import END_SEQ, REPLAY_WINDOW, KVEventBatch, decoder

log = logging.getLogger(__name__)

_END = int.from_bytes(END_SEQ, "big", signed=True)
#: The largest message a feed accepts (a batch of 4,096 events of 16-token blocks is ~0.5 MB).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
#: Replay requests one catch-up makes at most (each answers a window of the publisher's buffer).
MAX_REPLAY_ROUNDS = 64


@dataclass(slots=True)
class FeedStats:
    batches: int = 0  # applied, live or replayed
    replayed: int = 0  # of which from the replay socket
    gaps: int = 0  # jumps in the live sequence
    lost: int = 0  # ranges no replay could fill
    undecodable: int = 0  # messages that could not be decoded or applied (the feed goes on)
    restarts: int = 0  # the publisher's sequence went back (it restarted)
    last_seq: int = -1
    disconnects: int = 0  # connections to the publisher lost (and made again)
    last_applied_at: float | None = None  # time.monotonic() of the last batch applied
    lag_s: float = 0.0  # how old the last live batch was when it arrived (its ts against our clock)


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
        curve: Mapping[int, bytes] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        replay_window: int = REPLAY_WINDOW,
    ) -> None:
        """``curve``: CURVE client options (:func:`~prefixcache.kvevents.security.client_options`);
        ``max_message_bytes``: a larger message is dropped by ZeroMQ (the connection is reset);
        ``replay_window``: the publisher's most batches per replay answer (an answer that long
        is followed by another request from where it ended)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.on_batch = on_batch
        self.on_lost = on_lost or (lambda reason: None)
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.curve = dict(curve or {})
        self.max_message_bytes = max_message_bytes
        self.replay_window = replay_window
        self.stats = FeedStats()
        self._ctx = context or zmq.Context.instance()
        self._decode = decoder()
        self._recent: OrderedDict[int, float] = OrderedDict()  # seq -> ts of recently applied batches
        self._stop = threading.Event()
        self._warnings = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> EventFeed:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        for option, value in self.curve.items():
            sock.setsockopt(option, value)
        return sock

    def _run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        replay = self._replay_socket() if self.replay_endpoint is not None else None
        try:
            sub.connect(self.endpoint)
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        # ZeroMQ does not reconnect after a protocol error (a message over
                        # max_message_bytes): connect again ourselves.
                        self.stats.disconnects += 1
                        sub.disconnect(self.endpoint)
                        sub.connect(self.endpoint)
                    elif replay is not None:  # (re)connected: the publisher may have restarted
                        replay = self._verify(replay)
                if sub in ready:
                    frames = sub.recv_multipart()
                    try:
                        replay = self._receive(frames, replay)
                    except Exception as e:  # any frame, any error (RecursionError too): the feed goes on
                        self.stats.undecodable += 1
                        self._warn("a message could not be applied (%s: %s)", type(e).__name__, e)
        except zmq.ZMQError:
            if not self._stop.is_set():
                log.exception("kv events: the feed from %s failed", self.endpoint)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _receive(self, frames: list[bytes], replay: zmq.Socket | None) -> zmq.Socket | None:
        """One live message: apply it in order, replaying what it skipped."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.undecodable += 1
            return replay
        seq = int.from_bytes(frames[1], "big")
        last = self.stats.last_seq
        if seq <= last:
            if self._seen(seq, frames[2]):
                return replay  # already applied from a replay
            self._restarted(f"sequence {last} then {seq}")  # the same number on another batch
            last = -1
        if seq > last + 1:
            self.stats.gaps += 1
            if replay is not None:
                replay = self._catch_up(replay, last + 1, seq)
            if self.stats.last_seq < seq - 1:
                self._lost(f"batches {self.stats.last_seq + 1}..{seq - 1} missed and not replayed")
        self._apply(seq, frames[2], replayed=False)
        return replay

    def _restarted(self, why: str) -> None:
        """The publisher began a new stream (from 0): forget the old one's numbers."""
        self.stats.restarts += 1
        self._lost(f"the publisher restarted ({why})")
        self._recent.clear()
        self.stats.last_seq = -1

    def _replay_socket(self) -> zmq.Socket:
        sock = self._socket(zmq.DEALER)
        assert self.replay_endpoint is not None
        sock.connect(self.replay_endpoint)
        return sock

    def _fetch(self, sock: zmq.Socket, start: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from ``start`` on; None when it does not answer."""
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(self.replay_timeout_ms):
                log.warning("kv events: no replay answer from %s", self.replay_endpoint)
                return None
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the DEALER's empty delimiter
            if len(frames) == 3:
                frames = frames[1:]  # [topic, seq, payload] (vLLM >= 0.26); older: [seq, payload]
            if len(frames) != 2 or len(frames[0]) != 8:
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == _END or not frames[1]:
                return out
            out.append((seq, frames[1]))

    def _catch_up(self, sock: zmq.Socket, start: int, before: int | None) -> zmq.Socket:
        """Apply the buffered batches from ``start`` that continue the sequence, below ``before``
        (None: all). Returns the socket to use next (a fresh one after a timeout, so that a late
        answer is never read as the next one's)."""
        for _ in range(MAX_REPLAY_ROUNDS):  # a publisher answers a bounded window: ask on from its end
            batches = self._fetch(sock, start)
            if batches is None:
                sock.close(linger=0)
                return self._replay_socket()
            last = self.stats.last_seq
            self._apply_run(batches, before)
            cut = len(batches) >= self.replay_window  # a full window: the publisher may hold more
            if (
                not cut
                or self.stats.last_seq == last
                or (before is not None and batches[-1][0] >= before - 1)
            ):
                break
            start = self.stats.last_seq + 1
        return sock

    def _apply_run(self, batches: list[tuple[int, bytes]], before: int | None) -> None:
        for seq, payload in batches:
            last = self.stats.last_seq
            if seq <= last or (before is not None and seq >= before):
                continue
            if seq > last + 1:
                self._lost(f"batches {last + 1}..{seq - 1} are no longer in the publisher's buffer")
            self._apply(seq, payload, replayed=True)

    def _verify(self, sock: zmq.Socket) -> zmq.Socket:
        """On a (re)connection: catch up from 0 on a first one; else ask for the last batch
        applied again, and if the publisher no longer has it with the same timestamp, it
        restarted: follow its new stream from its start."""
        last = self.stats.last_seq
        if last < 0:
            return self._catch_up(sock, 0, None)
        batches = self._fetch(sock, last)
        if batches is None:
            sock.close(linger=0)
            return self._replay_socket()
        if batches and batches[0][0] == last and self._seen(last, batches[0][1]):
            self._apply_run(batches, None)  # the same stream: what came meanwhile
            return sock
        self._restarted("its last batch is gone")
        return self._catch_up(sock, 0, None)

    def _seen(self, seq: int, payload: bytes) -> bool:
        """Whether batch ``seq`` was applied already (a live copy of a replayed batch): the same
        number with the same timestamp."""
        try:
            ts = self._decode.decode(payload).ts
        except Exception:  # (DecodeError, RecursionError, ...): nothing to apply either way
            return True
        return self._recent.get(seq) == ts

    def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self.stats.last_seq = seq
        try:
            batch = self._decode.decode(payload)
        except Exception as e:  # DecodeError, ValidationError, RecursionError on deep nesting, ...
            self.stats.undecodable += 1
            self._lost(f"batch {seq} could not be decoded: {type(e).__name__}: {str(e)[:200]}")
            return
        self._recent[seq] = batch.ts
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)
        self.stats.batches += 1
        self.stats.replayed += int(replayed)
        self.stats.last_applied_at = time.monotonic()
        self.stats.lag_s = max(time.time() - float(batch.ts), 0.0) if not replayed else self.stats.lag_s
        try:
            self.on_batch(seq, batch)
        except Exception as e:  # a batch the consumer cannot apply (or its bug): counted, the feed goes on
            self.stats.undecodable += 1
            self._lost(f"batch {seq} could not be applied: {type(e).__name__}: {str(e)[:200]}")

    @property
    def alive(self) -> bool:
        """Whether the feed's thread runs (False before :meth:`start` and after it died or closed)."""
        return self._thread.is_alive()

    def _warn(self, message: str, *args: object) -> None:
        """A warning, the first ten and then every hundredth (a hostile stream must not flood the log)."""
        self._warnings += 1
        if self._warnings <= 10 or self._warnings % 100 == 0:
            log.warning(
                "kv events from %s: " + message + " [%d so far]", self.endpoint, *args, self._warnings
            )

    def _lost(self, reason: str) -> None:
        self.stats.lost += 1
        self._warn("%s", reason)
        try:
            self.on_lost(reason)
        except Exception:
            log.exception("kv events: the lost-batch callback failed")
