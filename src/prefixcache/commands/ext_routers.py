"""Routers other projects wrote, run in front of prefixcache replicas by ``prefixcache cluster
--router smg|vllm-router``: SMG (PyPI ``smg``) and vllm-router (PyPI ``vllm-router``), both Rust
binaries shipped in PyPI wheels, installed by ``pip install 'prefixcache[routers]'``.

What each gets from the replicas (see docs/scaleout.md):

* SMG ``cache_aware`` finds the engine through ``/v1/models`` and ``/version`` (read as vLLM),
  reads load from the ``vllm:`` gauges on ``/metrics``, and keeps its own prefix tree over the
  request text; ``--disable-tokenizer-autoload`` keeps it from fetching a tokenizer.
* vllm-router ``kv_aware`` subscribes to every replica's KV events (``--kv-event-source`` and
  ``--kv-event-replay-source``, block size 16), hashes ``BlockStored.token_ids`` itself, and asks
  the replica's ``/v1/chat/completions/render`` for a request's tokens.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prefixcache.commands.redis_process import free_port

#: ``--router`` values: the own router, or one of the binaries of the ``routers`` extra.
ROUTERS = ("prefixcache", "smg", "vllm-router")

#: Each external router's default policy (its own names).
DEFAULT_POLICY = {"smg": "cache_aware", "vllm-router": "kv_aware"}

INSTALL_HINT = "pip install 'prefixcache[routers]'"


@dataclass(frozen=True, slots=True)
class EventSource:
    """One replica's KV event sockets (``serve --kv-events-endpoint`` / ``--kv-events-replay-endpoint``)."""

    replica: str
    endpoint: str
    replay: str | None = None


def find_router(name: str) -> str:
    """The path of router binary ``name``: beside this Python first (a virtual environment's
    ``bin/``, where pip puts it), then on PATH. Missing: a ValueError that names the extra."""
    if name not in DEFAULT_POLICY:
        raise ValueError(f"'{name}' is not an external router; use one of: {', '.join(DEFAULT_POLICY)}")
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ValueError(f"{name} is not installed: {INSTALL_HINT} (the routers extra)")
    return found


def router_command(
    name: str,
    binary: str,
    replicas: list[str],
    *,
    host: str,
    port: int,
    policy: str | None = None,
    events: list[EventSource] | None = None,
    block_size: int = 16,
    model: str = "",
    api_key: str | None = None,
    log_level: str = "warning",
    metrics_port: int | None = None,
) -> list[str]:
    """The argv that starts router ``name`` on ``host:port`` in front of ``replicas``.
    ``events``: the replicas' KV event sockets (vllm-router ``kv_aware`` subscribes to them;
    ``model`` is the model id they serve, which it needs with static sources). Its own
    Prometheus exporter goes on ``host:metrics_port`` (default: a free port; both routers would
    otherwise take 29000, and a second router on the machine would fail to start)."""
    policy = policy or DEFAULT_POLICY[name]
    level = {"warning": "warn", "critical": "error"}.get(log_level, log_level)
    exporter = ["--prometheus-host", host, "--prometheus-port", str(metrics_port or free_port(host))]
    if name == "smg":
        cmd = [binary, "launch", "--host", host, "--port", str(port), *exporter, "--worker-urls", *replicas]
        cmd += ["--policy", policy, "--disable-tokenizer-autoload", "--log-level", level]
        if api_key:
            cmd += ["--api-key", api_key]
        return cmd
    cmd = [binary, "--host", host, "--port", str(port), *exporter, "--worker-urls", *replicas]
    cmd += ["--policy", policy]
    if events:
        for e in events:
            cmd += ["--kv-event-source", f"{e.replica}={e.endpoint}"]
        for e in events:
            if e.replay:
                cmd += ["--kv-event-replay-source", f"{e.replica}={e.replay}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    cmd += ["--log-level", {"warn": "warning"}.get(level, level)]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def wait_models(
    url: str, proc: subprocess.Popen[bytes], timeout_s: float, headers: dict[str, str] | None = None
) -> None:
    """Wait until a router at ``url`` lists a model (it has found a replica) or its process exits.
    ``headers``: a key, when the replicas want one (vllm-router forwards the question to them)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the router exited with status {proc.returncode} (see its log above)")
        try:
            r = httpx.get(url + "/v1/models", headers=headers, timeout=2.0)
            if r.status_code == 200 and r.json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url}: the router listed no model within {timeout_s:.0f}s")


class RouterProcess:
    """An external router as a child process (tests and benchmarks): ``with RouterProcess(cmd,
    url) as r:`` starts it, waits until it lists a model, and stops it (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        cmd: list[str],
        url: str,
        log: IO[bytes] | None = None,
        ready_s: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.cmd = cmd
        self.headers = headers
        self.url = url
        self.log = log
        self.ready_s = ready_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RouterProcess:
        out = self.log if self.log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_models(self.url, self.proc, self.ready_s, self.headers)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
        if p.poll() is None:
            p.kill()
            p.wait(5)

    def __exit__(self, *exc: object) -> None:
        self.stop()
