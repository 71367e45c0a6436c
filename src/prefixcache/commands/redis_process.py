"""The redis-server ``prefixcache cluster`` starts: bounded (``maxmemory`` and an eviction
policy), password-protected, its password in no argv and no log.

Why ``allkeys-lru`` by default: every key the tier writes is a cache block that any replica can
recompute, so any key may go; the tier sets a TTL on every entry, so ``volatile-lru`` would pick
from the same keys today, but it refuses writes (OOM errors, a tier write failure per block)
once memory is held by keys without a TTL, and evicts nothing then. ``allkeys-lru`` keeps
writes working under any mix and drops the least recently used blocks first, like the replicas'
own memory tier.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from pathlib import Path

import typer


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, for a child process (or a socket) to bind a moment later.

    Below the kernel's ephemeral range: a port from ``bind(0)`` comes from that range, which
    every outgoing connection also draws from, so it can be handed to another socket (a client's
    connect, another ``bind(0)``) before the child binds it, which then fails with 'Address
    already in use' (the suite lost a run to that)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range taken: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: Redis eviction policies (``maxmemory-policy``) the cluster accepts.
REDIS_POLICIES = (
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
    "noeviction",
)


def check_redis_policy(value: str) -> str:
    if value not in REDIS_POLICIES:
        raise typer.BadParameter(
            f"'{value}' is not a Redis eviction policy; use one of: {', '.join(REDIS_POLICIES)}"
        )
    return value


def redacted_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: what the logs may show."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<an unparsable Redis URL>"


def start_redis(
    binary: str,
    directory: str,
    *,
    maxmemory: int,
    policy: str,
    password: str,
    port: int | None = None,
    timeout_s: float = 10.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a free loopback port: no persistence, ``maxmemory`` bytes evicted by
    ``policy``, ``requirepass password``. The configuration goes in on stdin (``redis-server -``),
    so the password is in no process's argv. Returns the process and its URL (password in it:
    keep it out of argv and logs), once it answers an authenticated PING. ``port``: a given one
    (a restart where clients expect it), else a free one."""
    from urllib.parse import quote

    import redis

    port = port or free_port()
    config = (
        f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\ndir {directory}\n'
        f"maxmemory {maxmemory}\nmaxmemory-policy {policy}\nrequirepass {password}\n"
    )
    proc = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.stdin is not None
    proc.stdin.write(config.encode())
    proc.stdin.close()
    url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with redis.Redis.from_url(url, socket_timeout=1.0) as client:
                client.ping()
            return proc, url
        except redis.RedisError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(5)
                raise RuntimeError(
                    f"redis-server did not start on port {port} (exit status {proc.returncode})"
                ) from None
            time.sleep(0.05)


def redis_password_from(path: Path | None) -> str:
    """A random password, or the first line of ``path`` (no whitespace, quotes or backslashes:
    it goes into a Redis config line)."""
    if path is None:
        return secrets.token_urlsafe(32)
    try:
        lines = path.read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise typer.BadParameter(f"cannot read {path}: {e}", param_hint="--redis-password-file") from e
    password = lines[0].strip() if lines else ""
    if not password or any(c.isspace() or c in "\"'\\" for c in password):
        raise typer.BadParameter(
            f"{path} must hold a password on its first line, without spaces, quotes or backslashes",
            param_hint="--redis-password-file",
        )
    return password
