"""Option parsing shared by the commands: every bad value becomes one line naming the option and
what to write (typer's usage error, exit status 2), never a traceback."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

import typer


def duration(text: str, hint: str = "--ttl") -> float:
    """Seconds from ``300``, ``90s``, ``5m``, ``1h``."""
    from prefixcache.analysis.costs import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=hint) from None


def size(text: str, hint: str = "--capacity") -> int:
    """Bytes from ``16GiB``, ``512MB``, ``inf``."""
    from prefixcache.analysis.costs import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=hint) from None


def output_file(path: Path | None, hint: str, *, create_parents: bool = False) -> Path | None:
    """``path`` when a file can be written there: its folder exists, or (``create_parents``) is
    created now; checked before any work."""
    if path is None:
        return None
    parent = path.expanduser().resolve().parent
    if create_parents and not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise typer.BadParameter(
                f"cannot create the folder {parent}: {exc.strerror or exc}", param_hint=hint
            ) from None
    if not parent.is_dir():
        why = "is not a folder" if parent.exists() else "does not exist"
        raise typer.BadParameter(f"cannot write {path}: the folder {parent} {why}", param_hint=hint)
    if path.is_dir():
        raise typer.BadParameter(f"cannot write {path}: it is a directory", param_hint=hint)
    return path


def input_file(path: Path, hint: str, what: str = "file") -> Path:
    if not path.is_file():
        raise typer.BadParameter(f"no such {what}: {path}", param_hint=hint)
    return path


def http_url(text: str, hint: str) -> str:
    """An ``http(s)://host[:port]`` URL (what a replica or a server is reached at)."""
    parts = urlsplit(text.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise typer.BadParameter(f"{text!r} is not a URL: write e.g. http://127.0.0.1:8001", param_hint=hint)
    return text.strip().rstrip("/")


def free_port_or_fail(host: str, port: int, hint: str = "--port") -> None:
    """Fail at once when ``host:port`` cannot be listened on (taken, or a bad address), before
    a model loads for minutes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            reason = "already in use" if exc.errno == 98 else (exc.strerror or str(exc))
            raise typer.BadParameter(
                f"cannot listen on {host}:{port}: {reason}; pick another --port", param_hint=hint
            ) from None
