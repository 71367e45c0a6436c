"""Fixtures of the scale-out tests: a real redis-server, free ports, tensor-payload caches.

A missing redis-server skips the Redis tests, or fails them under CI (``redis_server_bin``,
tests/conftest.py)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixcache.commands.redis_process import free_port


@dataclass(slots=True)
class RedisServer:
    """A redis-server child process on a free loopback port, no persistence."""

    port: int
    directory: Path
    binary: str = "redis-server"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def client(self):  # noqa: ANN201 - redis.Redis
        import redis

        return redis.Redis.from_url(self.url)


def _start(tmp: Path, binary: str) -> RedisServer:
    server = RedisServer(port=free_port(), directory=tmp, binary=binary)
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory, redis_server_bin: str) -> Iterator[RedisServer]:
    """One redis-server for the session; use ``redis_url`` for a flushed instance per test."""
    server = _start(tmp_path_factory.mktemp("redis"), redis_server_bin)
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    c = redis_server.client()
    c.flushall()
    c.close()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path, redis_server_bin: str) -> Iterator[RedisServer]:
    """A redis-server of this test alone (tests that kill it)."""
    server = _start(tmp_path, redis_server_bin)
    yield server
    server.kill()


# ---------------------------------------------------------------------------- HTTP processes
FAKE_REPLICA = Path(__file__).with_name("fake_replica.py")


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up within {timeout_s}s")


@dataclass(slots=True)
class FakeReplica:
    name: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stats", timeout=5).json()


@pytest.fixture
def fake_replicas() -> Iterator[Callable[..., list[FakeReplica]]]:
    """``start(n, delay_s=0.0, modes=(), port=None)`` -> n fake replica processes, up and healthy;
    killed at teardown. ``modes[i]``: replica i's MODE (see fake_replica.py); ``port``: the first
    replica's port (to restart a killed one where the router expects it)."""
    started: list[FakeReplica] = []

    def start(
        n: int, delay_s: float | Sequence[float] = 0.0, modes: Sequence[str] = (), port: int | None = None
    ) -> list[FakeReplica]:
        out = []
        for i in range(n):
            p = port if port is not None and i == 0 else free_port()
            delay = delay_s[i] if isinstance(delay_s, Sequence) else delay_s
            mode = modes[i] if i < len(modes) else ""
            cmd = [sys.executable, str(FAKE_REPLICA), str(p), f"r{i}", str(delay), mode]
            out.append(FakeReplica(f"r{i}", p, subprocess.Popen(cmd)))
        started.extend(out)
        for r in out:
            wait_http(r.url + "/health")
        return out

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.kill()


class ServerThread:
    """A uvicorn server for an ASGI app in a daemon thread, on a free loopback port."""

    def __init__(self, app: object) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server thread did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def stop_process_tree(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Cleanup after a failed test: SIGTERM ``proc`` (a clean stop stops its children too), then
    kill whatever of it and its descendants is still running."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
