"""DiskTier: blocks as files in a directory, under a byte budget, least recently used first out.

Layout: ``<dir>/<key hex[:2]>/<key hex>.kv``, one :mod:`codec` entry per file. Writes go to
``<dir>/.tmp/`` and are moved in place with ``os.replace``, so a reader (or a process restarted
after a crash) sees either the whole entry or none; leftovers in ``.tmp`` are removed at start.
A new ``DiskTier`` over an existing directory indexes what is there (LRU order from mtimes), so
a restarted server is warm for everything it persisted. An entry that fails verification is a
counted miss, is never served, and is deleted.

Several processes may share a directory: a lookup opens the file whatever the in-memory index
says, so entries written by another process are found; each process enforces the budget only on
what it knows about.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixcache.cache.blocks import Block
from prefixcache.cache.tiers.base import BackgroundWriter, TierStats
from prefixcache.cache.tiers.codec import CorruptEntry, TensorCodec

log = logging.getLogger(__name__)

_SUFFIX = ".kv"


class DiskTier:
    """A persistent tier below memory. Thread-safe; ``put`` never blocks nor raises.

    ``write_through=True`` (the default) persists every committed block at once, in the
    background, so a restart is warm; ``False`` persists only blocks evicted from memory for lack
    of room (a spill tier). ``fsync=True`` also survives power loss, at a cost per write.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        capacity_bytes: int = 8 << 30,
        codec: TensorCodec | None = None,
        write_through: bool = True,
        fsync: bool = False,
        name: str = "disk",
        queue_size: int = 1024,
        queue_bytes: int = 256 << 20,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0; got {capacity_bytes}")
        self.name = name
        self.write_through = write_through
        self.directory = Path(directory)
        self.capacity_bytes = int(capacity_bytes)
        self.codec = codec or TensorCodec()
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key hex -> file size, LRU first
        self._bytes = 0
        self._stats = TierStats(name=name)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._tmp = self.directory / ".tmp"
        self._tmp.mkdir(exist_ok=True)
        self._load_index()
        self._writer = BackgroundWriter(name, maxsize=queue_size, max_bytes=queue_bytes)

    # ------------------------------------------------------------------ Tier protocol
    def get_many(self, keys: Sequence[bytes], tokens: Sequence[bytes]) -> list[tuple[Any, int]]:
        """Payloads of the leading run of ``keys`` found on disk and verified (key, parent chain,
        token ids, checksum). Stops at the first missing or bad entry; a bad one is deleted."""
        out: list[tuple[Any, int]] = []
        for index, key in enumerate(keys):
            key_hex = key.hex()
            path = self._path(key_hex)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                with self._lock:
                    self._forget(key_hex)
                    self._stats.misses += 1
                break
            except OSError as exc:
                log.warning("disk tier: cannot read %s: %s", path, exc)
                with self._lock:
                    self._stats.errors += 1
                break
            try:
                parent = keys[index - 1] if index else False
                entry = self.codec.decode(data, key=key, tokens=tokens[index], parent=parent)
            except CorruptEntry as exc:
                log.warning("disk tier: corrupt entry %s (%s): deleted, not served", path.name, exc)
                with self._lock:
                    self._stats.corrupt += 1
                    self._forget(key_hex)
                self._unlink(path)
                break
            with self._lock:
                self._stats.hits += 1
                if key_hex in self._index:
                    self._index.move_to_end(key_hex)
                else:  # written by another process sharing the directory
                    self._remember(key_hex, len(data))
            with contextlib.suppress(OSError):  # LRU order survives a restart through mtimes
                os.utime(path)
            out.append((entry.payload, entry.nbytes))
        return out

    def put(self, block: Block) -> None:
        """Persist ``block`` in the background (skipped if already held)."""
        key_hex = block.key.hex()
        with self._lock:
            if key_hex in self._index:
                return
        key, parent, tokens, payload = bytes(block.key), block.parent, block.tokens, block.payload
        if not self._writer.submit(lambda: self._write(key_hex, key, parent, tokens, payload), block.nbytes):
            with self._lock:
                self._stats.write_drops += 1

    # ------------------------------------------------------------------ admin
    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued write is on disk."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._writer.close()

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.entries = len(self._index)
            self._stats.bytes = self._bytes
            return TierStats(**self._stats.as_dict())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._path(key.hex()).exists()

    def path_of(self, key: bytes) -> Path:
        """Where ``key``'s entry lives (tests corrupt it)."""
        return self._path(key.hex())

    # ------------------------------------------------------------------ internals
    def _path(self, key_hex: str) -> Path:
        return self.directory / key_hex[:2] / f"{key_hex}{_SUFFIX}"

    def _write(self, key_hex: str, key: bytes, parent: bytes | None, tokens: bytes, payload: Any) -> None:
        try:
            data = self.codec.encode(key, parent, tokens, payload)
        except (TypeError, ValueError) as exc:
            log.warning("disk tier: cannot encode block %s: %s", key_hex[:12], exc)
            with self._lock:
                self._stats.write_drops += 1
            return
        if len(data) > self.capacity_bytes:
            with self._lock:
                self._stats.write_drops += 1
            return
        path = self._path(key_hex)
        tmp = self._tmp / f"{key_hex}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see all of it or nothing
        except OSError as exc:
            log.warning("disk tier: write of %s failed: %s", path, exc)
            self._unlink(tmp)
            with self._lock:
                self._stats.errors += 1
                self._stats.write_drops += 1
            return
        victims: list[str] = []
        with self._lock:
            self._stats.writes += 1
            self._forget(key_hex)
            self._remember(key_hex, len(data))
            while self._bytes > self.capacity_bytes and self._index:
                old, size = self._index.popitem(last=False)
                self._bytes -= size
                self._stats.evictions += 1
                victims.append(old)
        for old in victims:
            self._unlink(self._path(old))

    def _remember(self, key_hex: str, size: int) -> None:  # caller holds the lock
        self._index[key_hex] = size
        self._bytes += size

    def _forget(self, key_hex: str) -> None:  # caller holds the lock
        size = self._index.pop(key_hex, None)
        if size is not None:
            self._bytes -= size

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk tier: cannot remove %s: %s", path, exc)

    def _load_index(self) -> None:
        """Index the entries already on disk (oldest mtime first) and clear interrupted writes."""
        for tmp in self._tmp.iterdir():
            self._unlink(tmp)
        found: list[tuple[float, str, int]] = []
        for sub in self.directory.iterdir():
            if not sub.is_dir() or sub.name.startswith("."):
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(_SUFFIX) and entry.is_file():
                    status = entry.stat()
                    found.append((status.st_mtime, entry.name[: -len(_SUFFIX)], status.st_size))
        found.sort()
        for _, key_hex, size in found:
            self._remember(key_hex, size)
        if found:
            log.info("disk tier %s: %d entries, %d bytes found", self.directory, len(found), self._bytes)
        victims: list[str] = []
        while self._bytes > self.capacity_bytes and self._index:  # the budget may have shrunk
            old, size = self._index.popitem(last=False)
            self._bytes -= size
            victims.append(old)
        for old in victims:
            self._unlink(self._path(old))
