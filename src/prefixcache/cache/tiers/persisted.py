"""Warm restarts: the salt secret kept with the disk tier, and the namespaces no secret reads.

Every disk entry is authenticated with a key derived from the server's salt secret, and every
tenant's directory is named by a keyed digest of it. A secret that is random per process
therefore makes every restart write a fresh namespace that no later process can read.

* :func:`persisted_secret`: the secret stored in ``<disk dir>/salt-secret`` (64 hex digits, 32
  random bytes), created 0600 on first start; a file readable or writable by others, a symbolic
  link or anything but a regular file of its owner is refused (:class:`SecretFileError`).
  An explicitly given secret (``$PREFIXCACHE_SALT_SECRET``, ``--salt-secret-file``) wins over it.
* :func:`stale_namespaces`: the namespace directories whose entries were written with another
  secret (their MAC does not verify with this one), with their entries and bytes;
  :func:`remove_namespaces` deletes them (``prefixcache cache gc DIR``).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from prefixcache.cache.tiers.codec import CorruptEntry, TensorCodec

SECRET_NAME = "salt-secret"
_SECRET_TEXT = re.compile(r"[0-9a-f]{64}")
_TAG_NAME = re.compile(r"[0-9a-f]{32}")
_FAN_NAME = re.compile(r"[0-9a-f]{2}")
#: Entries tried per namespace before it is called unreadable (a torn or altered one is skipped).
_SAMPLES = 3


class SecretFileError(ValueError):
    """The persisted secret cannot be used: the message says what to fix."""


def secret_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / SECRET_NAME


def read_persisted_secret(directory: str | os.PathLike[str]) -> str | None:
    """The secret stored in ``directory`` (None when there is none). Raises SecretFileError for a
    file whose mode is wider than 0600, that is not a regular file, not its user's, or malformed."""
    path = secret_path(directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecretFileError(f"{path} is a symbolic link: remove it (a new secret is created)") from exc
        raise SecretFileError(f"cannot read the salt secret {path}: {exc.strerror or exc}") from exc
    with open(fd, encoding="ascii", errors="replace") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretFileError(
                f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others could read the salt secret; "
                f"run chmod 600 {path}"
            )
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise SecretFileError(f"{path} belongs to another user (uid {st.st_uid})")
        text = f.read(4096).strip()
    if not _SECRET_TEXT.fullmatch(text):
        raise SecretFileError(
            f"{path} is not a salt secret written by prefixcache (64 hex digits); "
            "restore it or remove it (the disk tier's entries are then unreadable)"
        )
    return text


def persisted_secret(directory: str | os.PathLike[str]) -> tuple[str, bool]:
    """The secret kept in ``directory`` (created 0700 if missing), and whether it was created now.
    A new one is 32 random bytes as 64 hex digits, written 0600 with ``O_EXCL`` (two servers
    starting together agree on one)."""
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = read_persisted_secret(root)
    if found is not None:
        return found, False
    path = secret_path(root)
    text = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # another process created it first: use that one
        again = read_persisted_secret(root)
        if again is None:
            raise SecretFileError(f"{path} vanished while starting; start again") from None
        return again, False
    except OSError as exc:
        raise SecretFileError(f"cannot create the salt secret {path}: {exc.strerror or exc}") from exc
    with open(fd, "w", encoding="ascii") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    return text, True


@dataclass(frozen=True, slots=True)
class Namespace:
    """One namespace directory of a disk tier."""

    tag: str
    entries: int
    bytes: int
    readable: bool  # an entry verified with the secret at hand (or it holds none)


def scan_namespaces(directory: str | os.PathLike[str], codec: TensorCodec) -> list[Namespace]:
    """Every namespace directory under ``directory``, largest first. Names that are not the
    tier's layout are ignored and no symbolic link is followed."""
    out: list[Namespace] = []
    try:
        tops = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for ns in tops:
        if not (_TAG_NAME.fullmatch(ns.name) and ns.is_dir(follow_symlinks=False)):
            continue
        files: list[str] = []
        size = 0
        for fan in os.scandir(ns.path):
            if not (_FAN_NAME.fullmatch(fan.name) and fan.is_dir(follow_symlinks=False)):
                continue
            for entry in os.scandir(fan.path):
                if entry.name.endswith(".kv") and entry.is_file(follow_symlinks=False):
                    files.append(entry.path)
                    size += entry.stat(follow_symlinks=False).st_size
        out.append(Namespace(ns.name, len(files), size, _readable(files, codec)))
    out.sort(key=lambda n: (-n.bytes, n.tag))
    return out


def stale_namespaces(directory: str | os.PathLike[str], codec: TensorCodec) -> list[Namespace]:
    """The namespaces written with another secret: nothing in them can be read with ``codec``."""
    return [n for n in scan_namespaces(directory, codec) if not n.readable]


def remove_namespaces(directory: str | os.PathLike[str], namespaces: list[Namespace]) -> int:
    """Delete these namespace directories; returns the bytes freed."""
    freed = 0
    for ns in namespaces:
        if not _TAG_NAME.fullmatch(ns.tag):
            raise ValueError(f"invalid namespace tag {ns.tag!r}")
        path = Path(directory) / ns.tag
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            freed += ns.bytes
    return freed


def _readable(files: list[str], codec: TensorCodec) -> bool:
    """Whether one of the first few entries verifies with ``codec`` (True when none could be
    judged: an empty directory, or only torn entries, is not called another secret's)."""
    judged = False
    for path in sorted(files)[:_SAMPLES]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with open(fd, "rb") as f:
                data = f.read()
            codec.decode(data)
            return True
        except CorruptEntry as exc:
            if "MAC" in str(exc):
                judged = True
        except OSError:
            continue
    return not judged
