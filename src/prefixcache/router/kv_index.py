"""A precise view of the replicas' caches from their KV events, for the cache-aware policy.

Each replica given to ``prefixcache route --kv-events URL=ENDPOINT`` is followed by an
:class:`~prefixcache.kvevents.subscriber.EventFeed`; :class:`ReplicaBlocks` applies its batches:
the block hashes it holds (as 64-bit integers), the ones it recently removed and when, and
whether the view is *synced* (complete: it has seen the stream from its first batch, or an
``AllBlocksCleared``, with no gap since).

The router cannot compute a request's block hashes (they are hashes of token ids under the
tenant's secret salt; the router has no tokenizer and no salts). So it learns them: a request
routed with events on asks the replica for its prompt's block hashes
(``x-prefixcache-want-blocks``; the answer's ``x-prefixcache-blocks`` lists them), and
:class:`BlockAnchors` ties each of the request's routing chunks (the chained hashes of its
rendered text, :mod:`~prefixcache.router.affinity`) to the block that ends where that chunk's
text ends, by proportion: chunk ``j`` covers the first ``(j+1) * chunk_chars`` of ``L`` rendered
characters, so about ``(j+1) * chunk_chars / L`` of the prompt's tokens; the anchor is the block
ending at :data:`ANCHOR_MARGIN` of that point (short of it, so that it lies inside the text the
next request shares). Replicas of one cluster share the model and the tenants' salts (a shared
tier needs that too), so one anchor names the same block on every replica.

A replica *holds* a request's prefix through chunk ``j`` when (:meth:`KVIndex.depth`):

* its view is synced and holds the chunk's anchor; or
* the approximate record (:class:`~prefixcache.router.policies.PrefixRecord`) sent the chunk
  there, and its events have not removed the anchor since, and (when synced) the request was
  routed after the anchor was learned (it is being computed there now);
* with no feed for that replica, or no anchor for that chunk yet, the record alone decides (the
  router's behaviour without events).

So a prefix evicted on a replica stops attracting requests to it as soon as the ``BlockRemoved``
arrives; with nothing held anywhere, the request goes to the least-loaded replica.

A feed survives any message (every decode or apply error is counted as ``undecodable``). A
replica whose feed thread died is routed as one without events; one whose feed lags (its last
live batch older than ``max_lag_s`` on arrival) is treated as unsynced; a view past ``max_held``
blocks starts again empty and unsynced (memory stays bounded).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.kvevents.subscriber import EventFeed
from prefixcache.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_as_int

#: The anchor of a chunk ends this far into the chunk's share of the prompt's tokens.
ANCHOR_MARGIN = 0.9
#: A feed whose last live batch was older than this when it arrived is not trusted (unsynced).
DEFAULT_MAX_LAG_S = 10.0


@dataclass(frozen=True, slots=True)
class FeedSpec:
    """Where one replica publishes (``route --kv-events URL=ENDPOINT[,REPLAY]``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def parse_feed(spec: str) -> tuple[str, FeedSpec]:
    """``http://host:8000=tcp://host:5557[,tcp://host:5558]`` -> (replica url, feed). ValueError
    with the expected shape otherwise."""
    url, sep, rest = spec.partition("=")
    parts = [p.strip() for p in rest.split(",") if p.strip()]
    if not sep or not url.startswith(("http://", "https://")) or not 1 <= len(parts) <= 2:
        raise ValueError(
            f"--kv-events '{spec}' is not REPLICA_URL=PUB_ENDPOINT[,REPLAY_ENDPOINT], e.g. "
            "http://127.0.0.1:8001=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"
        )
    for p in parts:
        if not p.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events '{spec}': '{p}' is not a ZeroMQ address (tcp://host:port)")
    return url.rstrip("/"), FeedSpec(parts[0], parts[1] if len(parts) == 2 else None)


@dataclass(slots=True)
class ReplicaBlocks:
    """One replica's cache as its events tell it (not thread-safe: :class:`KVIndex` locks)."""

    held: set[int] = field(default_factory=set)
    removed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> when
    synced: bool = False
    live: bool = False  # a batch arrived (the replica publishes)
    max_removed: int = 100_000
    #: blocks the view tracks at most: beyond, it starts empty and unsynced (bounded memory)
    max_held: int = 1_000_000
    overflows: int = 0

    def apply(self, seq: int, batch: KVEventBatch, now: float) -> None:
        if seq == 0:  # a stream's first batch (a publisher's start): nothing came before it
            self._clear(now)
            self.synced = True
        self.live = True
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    key = hash_as_int(h)
                    self.held.add(key)
                    self.removed.pop(key, None)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    key = hash_as_int(h)
                    self.held.discard(key)
                    self.removed[key] = now
                    self.removed.move_to_end(key)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(now)
                self.synced = True
        if len(self.held) > self.max_held:
            self.held.clear()
            self.synced = False
            self.overflows += 1
        while len(self.removed) > self.max_removed:
            self.removed.popitem(last=False)

    def _clear(self, now: float) -> None:
        for key in self.held:
            self.removed[key] = now
            self.removed.move_to_end(key)
        self.held.clear()

    def removed_since(self, key: int, t: float) -> bool:
        when = self.removed.get(key)
        return when is not None and when >= t


@dataclass(slots=True)
class BlockAnchors:
    """Routing chunk hash -> (block hash, when learned), LRU-bounded."""

    chunk_chars: int
    max_entries: int = 200_000
    _map: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict)

    def learn(self, chunks: Sequence[str], rendered_chars: int, header: str, now: float) -> int:
        """Tie ``chunks`` to the blocks listed in an ``x-prefixcache-blocks`` header (see the
        module docstring). Returns the anchors set; 0 for a malformed header."""
        try:
            tokens_s, block_s, hashes_s = header.split(" ", 2)
            prompt_tokens, block_size = int(tokens_s), int(block_s)
            hashes = [int(h, 16) for h in hashes_s.split(",") if h]
        except ValueError:
            return 0
        if rendered_chars <= 0 or block_size <= 0 or not hashes:
            return 0
        learned = 0
        for j, chunk in enumerate(chunks):
            end = (j + 1) * self.chunk_chars
            if end > rendered_chars:
                break
            block = int(end / rendered_chars * prompt_tokens * ANCHOR_MARGIN) // block_size - 1
            if 0 <= block < len(hashes):
                self._map[chunk] = (hashes[block], now)
                self._map.move_to_end(chunk)
                learned += 1
        while len(self._map) > self.max_entries:
            self._map.popitem(last=False)
        return learned

    def get(self, chunk: str) -> tuple[int, float] | None:
        return self._map.get(chunk)

    def blocks(self) -> set[int]:
        """Every anchor's block hash."""
        return {block for block, _ in self._map.values()}

    def __len__(self) -> int:
        return len(self._map)


#: ``entry(chunk) -> (url, recorded at) | None``: the approximate record's view of one chunk.
RecordEntry = Callable[[str], "tuple[str, float] | None"]


class KVIndex:
    """The replicas' event views and the learned anchors, behind one lock (the feeds' threads
    write, the router reads)."""

    def __init__(
        self,
        feeds: Mapping[str, FeedSpec],
        chunk_chars: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        curve: Mapping[int, bytes] | None = None,
        max_lag_s: float = DEFAULT_MAX_LAG_S,
    ) -> None:
        """``curve``: CURVE client options for every feed (:mod:`prefixcache.kvevents.security`).
        ``max_lag_s``: a feed whose last live batch arrived older than this is not trusted."""
        self.specs = dict(feeds)
        self.curve = curve
        self.max_lag_s = max_lag_s
        self.clock = clock
        self.anchors = BlockAnchors(chunk_chars)
        self.replicas = {url: ReplicaBlocks() for url in self.specs}
        self._feeds: dict[str, EventFeed] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ feeds
    def start(self) -> None:
        for url, spec in self.specs.items():
            self._feeds[url] = EventFeed(
                spec.endpoint,
                spec.replay_endpoint,
                topic=spec.topic,
                on_batch=lambda seq, batch, url=url: self.apply(url, seq, batch),
                on_lost=lambda reason, url=url: self.lost(url),
                curve=self.curve,
            ).start()

    def close(self) -> None:
        for feed in self._feeds.values():
            feed.close()
        self._feeds.clear()

    def feed(self, url: str) -> EventFeed | None:
        """The event feed of replica ``url`` (None before :meth:`start`, after :meth:`close`, or
        for a replica without one): its ``alive`` and ``stats`` are what routing trusts."""
        with self._lock:
            return self._feeds.get(url)

    def apply(self, url: str, seq: int, batch: KVEventBatch) -> None:
        with self._lock:
            self.replicas[url].apply(seq, batch, self.clock())

    def lost(self, url: str) -> None:
        """A gap no replay filled: the view of ``url`` may miss blocks, or keep removed ones."""
        with self._lock:
            self.replicas[url].synced = False

    def learn(self, chunks: Sequence[str], rendered_chars: int, header: str) -> int:
        with self._lock:
            return self.anchors.learn(chunks, rendered_chars, header, self.clock())

    # ------------------------------------------------------------------ routing
    def _view(self, url: str) -> tuple[ReplicaBlocks | None, bool]:
        """(the view of ``url`` to route on, whether it is synced): no view when its feed died
        (the record and the load decide, as without events); not synced when the feed lags."""
        view = self.replicas.get(url)
        feed = self._feeds.get(url)
        if view is None or (feed is not None and not feed.alive):
            return None, False
        lagging = feed is not None and feed.stats.lag_s > self.max_lag_s
        return view, view.synced and not lagging

    def publishes(self, urls: Sequence[str]) -> bool:
        """Whether any of ``urls`` has a live feed."""
        with self._lock:
            return any((v := self._view(u)[0]) is not None and v.live for u in urls)

    def depth(self, url: str, chunks: Sequence[str], entry: RecordEntry) -> int:
        """Chunks of this request's prefix that ``url`` holds (see the module docstring)."""
        with self._lock:
            view, synced = self._view(url)
            for j in range(len(chunks) - 1, -1, -1):
                if self._holds(url, view, synced, chunks[j], entry):
                    return j + 1
        return 0

    def _holds(
        self, url: str, view: ReplicaBlocks | None, synced: bool, chunk: str, entry: RecordEntry
    ) -> bool:
        rec = entry(chunk)
        from_record = rec is not None and rec[0] == url
        anchor = self.anchors.get(chunk)
        if view is None or not view.live or anchor is None:
            return from_record
        block, learned_at = anchor
        if synced and block in view.held:
            return True
        if not from_record:
            return False
        assert rec is not None
        if view.removed_since(block, rec[1]):
            return False
        return not synced or rec[1] >= learned_at

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            out = {}
            for url, view in self.replicas.items():
                feed = self._feeds.get(url)
                stats = feed.stats if feed is not None else None
                _, synced = self._view(url)
                out[url] = {
                    "endpoint": self.specs[url].endpoint,
                    "live": view.live,
                    "synced": synced,
                    "feed_alive": feed.alive if feed is not None else False,
                    "lag_s": round(stats.lag_s, 3) if stats else 0.0,
                    "undecodable": stats.undecodable if stats else 0,
                    "overflows": view.overflows,
                    "blocks": len(view.held),
                    "batches": stats.batches if stats else 0,
                    "replayed": stats.replayed if stats else 0,
                    "gaps": stats.gaps if stats else 0,
                    "lost": stats.lost if stats else 0,
                    "last_seq": stats.last_seq if stats else -1,
                }
            return out
