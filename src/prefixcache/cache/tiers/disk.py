"""DiskTier: blocks as files in a directory, under a byte budget, least recently used first out.

Layout: ``<dir>/<namespace tag>/<key hex[:2]>/<key hex>.kv``, one :mod:`codec` entry per file;
the namespace tag is a keyed digest of the tenant's namespace root
(:meth:`~.codec.TensorCodec.namespace_tag`), so a tenant's ``DELETE /v1/cache`` removes one
directory and nothing of another tenant's. Every name is checked (64 or 32 lowercase hex digits)
before a path is built from it. Directories are created 0700 and files 0600; entries are read
without following symbolic links.

Writes go to ``<dir>/.tmp/`` and are moved in place with ``os.replace``, so a reader (or a
process restarted after a crash) sees either the whole entry or none; leftovers in ``.tmp`` are
removed at start. A new ``DiskTier`` over an existing directory indexes what is there (LRU order
from mtimes), so a restarted server is warm for everything it persisted. An entry that fails
verification (MAC, layout, key, parent, tokens) is a counted miss, is never served, and is deleted.

Several processes may share a directory: a lookup opens the file whatever the in-memory index
says, so entries written by another process are found; each process enforces the budget only on
what it knows about.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixcache.cache.blocks import Block
from prefixcache.cache.tiers.base import BackgroundWriter, TierStats
from prefixcache.cache.tiers.codec import BlockLayout, CorruptEntry, TensorCodec

log = logging.getLogger(__name__)

#: The disk tier's byte budget when none is given (``serve --disk-cache-size``).
DEFAULT_DISK_BYTES = 8 << 30
_SUFFIX = ".kv"
_KEY_NAME = re.compile(r"[0-9a-f]{64}")
_TAG_NAME = re.compile(r"[0-9a-f]{32}")
_FAN_NAME = re.compile(r"[0-9a-f]{2}")
#: An entry file larger than its layout's payload plus this much is refused unread.
_ENTRY_OVERHEAD = 64 << 10


def check_name(name: str, pattern: re.Pattern[str], what: str) -> str:
    """``name`` when it is exactly ``pattern`` (hex digits only: no separator, no ``..``);
    ValueError otherwise."""
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise ValueError(f"invalid {what} {name!r}: expected {pattern.pattern}")
    return name


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
        capacity_bytes: int = DEFAULT_DISK_BYTES,
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
        self._index: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key hex -> (tag, size), LRU first
        self._bytes = 0
        self._stats = TierStats(name=name)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._tmp = self.directory / ".tmp"
        self._tmp.mkdir(mode=0o700, exist_ok=True)
        self._load_index()
        self._writer = BackgroundWriter(name, maxsize=queue_size, max_bytes=queue_bytes)

    # ------------------------------------------------------------------ Tier protocol
    def get_many(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[bytes],
        namespace: bytes,
        layout: BlockLayout | None = None,
    ) -> list[tuple[Any, int]]:
        """Payloads of the leading run of ``keys`` found on disk and verified (MAC, layout, key,
        parent chain, token ids). Stops at the first missing or bad entry; a bad one is deleted."""
        out: list[tuple[Any, int]] = []
        tag = self.codec.namespace_tag(namespace)
        limit = _ENTRY_OVERHEAD + _payload_bytes(layout) if layout is not None else None
        for index, key in enumerate(keys):
            key_hex = key.hex()
            path = self.entry_path(tag, key_hex)
            try:
                data = _read_entry(path, limit)
                parent = keys[index - 1] if index else False
                entry = self.codec.decode(data, key=key, tokens=tokens[index], parent=parent, layout=layout)
            except FileNotFoundError:
                with self._lock:
                    self._forget(key_hex)
                    self._stats.misses += 1
                break
            except CorruptEntry as exc:
                log.warning("disk tier: corrupt entry %s (%s): deleted, not served", path.name, exc)
                with self._lock:
                    self._stats.corrupt += 1
                    self._forget(key_hex)
                self._unlink(path)
                break
            except OSError as exc:
                log.warning("disk tier: cannot read %s: %s", path, exc)
                with self._lock:
                    self._stats.errors += 1
                break
            with self._lock:
                self._stats.hits += 1
                if key_hex in self._index:
                    self._index.move_to_end(key_hex)
                else:  # written by another process sharing the directory
                    self._remember(key_hex, tag, len(data))
            with contextlib.suppress(OSError):  # LRU order survives a restart through mtimes
                os.utime(path, follow_symlinks=False)
            out.append((entry.payload, entry.nbytes))
        return out

    def put(self, block: Block) -> None:
        """Persist ``block`` in the background (skipped if already held)."""
        key_hex = block.key.hex()
        with self._lock:
            if key_hex in self._index:
                return
        tag = self.codec.namespace_tag(block.namespace)
        key, parent, tokens, payload = bytes(block.key), block.parent, block.tokens, block.payload
        job = lambda: self._write(tag, key_hex, key, parent, tokens, payload)  # noqa: E731
        if not self._writer.submit(job, block.nbytes):
            with self._lock:
                self._stats.write_drops += 1

    def remove_namespace(self, namespace: bytes) -> int:
        """Delete the namespace's directory (every entry of it, whichever process wrote it),
        after the writes queued so far. Returns entries removed."""
        self._writer.flush(30.0)
        tag = self.codec.namespace_tag(namespace)
        with self._lock:
            for key_hex in [k for k, (t, _) in self._index.items() if t == tag]:
                self._forget(key_hex)
        src = self.directory / check_name(tag, _TAG_NAME, "namespace tag")
        doomed = self._tmp / f"{tag}.{os.getpid()}.{threading.get_ident()}.removed"
        try:
            os.replace(src, doomed)  # atomic: a reader sees the whole namespace or none of it
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning("disk tier: cannot remove namespace directory %s: %s", src, exc)
            with self._lock:
                self._stats.errors += 1
            return 0
        removed = sum(1 for _, _, files in os.walk(doomed) for f in files if f.endswith(_SUFFIX))
        shutil.rmtree(doomed, ignore_errors=True)
        return removed

    def remove_keys(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Delete the entries ``keys`` of the namespace root ``namespace`` (after the writes queued
        so far): a block the exactness audit found wrong is never promoted again. Returns removed."""
        self._writer.flush(30.0)
        tag = self.codec.namespace_tag(namespace)
        removed = 0
        for key in keys:
            path = self.entry_path(tag, key.hex())
            with self._lock:
                self._forget(key.hex())
            if path.exists():
                self._unlink(path)
                removed += 1
        return removed

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
        if not isinstance(key, bytes):
            return False
        with self._lock:
            held = self._index.get(key.hex())
        return held is not None and self.entry_path(held[0], key.hex()).exists()

    def path_of(self, key: bytes, namespace: bytes | None = None) -> Path:
        """Where ``key``'s entry lives (tests alter it): under ``namespace`` (a root), else where
        this process indexed it (KeyError if it did not)."""
        if namespace is not None:
            return self.entry_path(self.codec.namespace_tag(namespace), key.hex())
        with self._lock:
            tag = self._index[key.hex()][0]
        return self.entry_path(tag, key.hex())

    def entry_path(self, tag: str, key_hex: str) -> Path:
        """The file of entry ``key_hex`` (64 hex digits) in namespace ``tag`` (32): ValueError
        for any other name, before a path is built."""
        check_name(tag, _TAG_NAME, "namespace tag")
        check_name(key_hex, _KEY_NAME, "entry name")
        return self.directory / tag / key_hex[:2] / f"{key_hex}{_SUFFIX}"

    # ------------------------------------------------------------------ internals
    def _write(
        self, tag: str, key_hex: str, key: bytes, parent: bytes | None, tokens: bytes, payload: Any
    ) -> None:
        try:
            data = self.codec.encode(key, parent, tokens, payload)
            path = self.entry_path(tag, key_hex)
        except (TypeError, ValueError) as exc:
            log.warning("disk tier: cannot encode block %s: %s", key_hex[:12], exc)
            with self._lock:
                self._stats.write_drops += 1
            return
        if len(data) > self.capacity_bytes:
            with self._lock:
                self._stats.write_drops += 1
            return
        tmp = self._tmp / f"{key_hex}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            path.parent.parent.mkdir(mode=0o700, exist_ok=True)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
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
        victims: list[tuple[str, str]] = []
        with self._lock:
            self._stats.writes += 1
            self._forget(key_hex)
            self._remember(key_hex, tag, len(data))
            while self._bytes > self.capacity_bytes and self._index:
                old, (old_tag, size) = self._index.popitem(last=False)
                self._bytes -= size
                self._stats.evictions += 1
                victims.append((old_tag, old))
        for old_tag, old in victims:
            self._unlink(self.entry_path(old_tag, old))

    def _remember(self, key_hex: str, tag: str, size: int) -> None:  # caller holds the lock
        self._index[key_hex] = (tag, size)
        self._bytes += size

    def _forget(self, key_hex: str) -> None:  # caller holds the lock
        held = self._index.pop(key_hex, None)
        if held is not None:
            self._bytes -= held[1]

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk tier: cannot remove %s: %s", path, exc)

    def _load_index(self) -> None:
        """Index the entries already on disk (oldest mtime first) and clear interrupted writes.
        Names that are not this layout's (hex digits only) are ignored, never followed."""
        for tmp in self._tmp.iterdir():
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._unlink(tmp)
        found: list[tuple[float, str, str, int]] = []
        for ns_dir in os.scandir(self.directory):
            if not (_TAG_NAME.fullmatch(ns_dir.name) and ns_dir.is_dir(follow_symlinks=False)):
                continue
            for fan in os.scandir(ns_dir.path):
                if not (_FAN_NAME.fullmatch(fan.name) and fan.is_dir(follow_symlinks=False)):
                    continue
                for entry in os.scandir(fan.path):
                    key_hex = entry.name[: -len(_SUFFIX)]
                    named = entry.name.endswith(_SUFFIX) and _KEY_NAME.fullmatch(key_hex)
                    if named and entry.is_file(follow_symlinks=False):
                        status = entry.stat(follow_symlinks=False)
                        found.append((status.st_mtime, key_hex, ns_dir.name, status.st_size))
        found.sort()
        for _, key_hex, tag, size in found:
            self._remember(key_hex, tag, size)
        if found:
            log.info("disk tier %s: %d entries, %d bytes found", self.directory, len(found), self._bytes)
        victims: list[tuple[str, str]] = []
        while self._bytes > self.capacity_bytes and self._index:  # the budget may have shrunk
            old, (tag, size) = self._index.popitem(last=False)
            self._bytes -= size
            victims.append((tag, old))
        for tag, old in victims:
            self._unlink(self.entry_path(tag, old))


def _payload_bytes(layout: BlockLayout) -> int:
    n = 1
    for d in layout.shape:
        n *= d
    return n * 8  # the widest dtype: a bound, not the exact size


def _read_entry(path: Path, limit: int | None) -> bytes:
    """The file's bytes, without following a symbolic link (CorruptEntry for one) and without
    reading a file larger than ``limit`` (CorruptEntry)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptEntry("a symbolic link, not an entry") from exc
        raise
    with open(fd, "rb") as f:
        if limit is not None and os.fstat(f.fileno()).st_size > limit:
            raise CorruptEntry(f"file larger than an entry of this layout ({limit} bytes)")
        return f.read()
