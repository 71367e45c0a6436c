"""CLI commands of the scale-out layer: ``prefixcache cluster`` (Redis, N ``prefixcache serve
--redis ...`` replicas and the router, on loopback); ``prefixcache route`` is in ``route.py``.

Heavy imports (uvicorn, torch, the engine) happen inside the functions so ``--help`` stays instant.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cache.config import DEFAULTS
from prefixcache.commands import router_security
from prefixcache.commands.ext_routers import ROUTERS, EventSource, find_router, router_command, wait_models
from prefixcache.commands.lifecycle import sigterm_as_interrupt
from prefixcache.commands.options import duration, free_port_or_fail, input_file
from prefixcache.commands.redis_process import (
    check_redis_policy,
    free_port,
    redacted_url,
    redis_password_from,
    start_redis,
)
from prefixcache.commands.route import DEFAULT_MAX_CONNECTIONS, check_policy, route
from prefixcache.commands.router_security import curve_client, keepwarm_keys, router_keys
from prefixcache.commands.server import TenantCapacityShare, parse_bytes
from prefixcache.commands.warm import cluster_secret


def _check_router(value: str) -> str:
    if value not in ROUTERS:
        raise typer.BadParameter(f"'{value}' is not a router; use one of: {', '.join(ROUTERS)}")
    return value


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with status {proc.returncode} (see its log above)")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not healthy within {timeout_s:.0f}s")


def model_name_of(model: str | None) -> str:
    """The model id ``serve`` gives a model by default (what clients and routers must send)."""
    from prefixcache.server.app import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if model is None else Path(model).stem


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait(5)


def cluster(
    replicas: Annotated[
        int, typer.Option("--replicas", "-n", min=1, max=16, help="Replica servers to start.")
    ] = 2,
    port: Annotated[int, typer.Option(help="The router's port (the one clients use).")] = 8000,
    host: Annotated[
        str, typer.Option(help="The router's interface; replicas and Redis stay on loopback.")
    ] = "127.0.0.1",
    policy: Annotated[
        str, typer.Option(callback=check_policy, help="Routing policy (see `route --help`).")
    ] = "cache-aware",
    model: Annotated[
        str | None, typer.Option(help="GGUF file or HF folder (default: embedded SmolLM2).")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Use this Redis instead of starting redis-server.")
    ] = None,
    no_redis: Annotated[
        bool, typer.Option("--no-redis", help="No shared tier (each replica caches alone).")
    ] = False,
    redis_sync_writes: Annotated[
        bool, typer.Option("--redis-sync-writes", help="Replicas write blocks to Redis synchronously.")
    ] = False,
    redis_maxmemory: Annotated[
        str,
        typer.Option(
            help="Memory cap of the redis-server the cluster starts (its maxmemory), e.g. 1GiB; beyond "
            "it Redis evicts by --redis-maxmemory-policy. Not applied to a --redis URL.",
        ),
    ] = "1GiB",
    redis_maxmemory_policy: Annotated[
        str,
        typer.Option(
            callback=check_redis_policy,
            help="What the started redis-server evicts at --redis-maxmemory: allkeys-lru (default: every "
            "entry is a recomputable cache block), allkeys-lfu, volatile-lru, ..., or noeviction.",
        ),
    ] = "allkeys-lru",
    redis_password_file: Annotated[
        Path | None,
        typer.Option(
            "--redis-password-file",
            help="The started redis-server's password (first line of the file). Default: a random one. "
            "Replicas get it in their environment, never on a command line or in a log.",
        ),
    ] = None,
    disk_cache: Annotated[
        Path | None, typer.Option("--disk-cache", help="Give each replica a disk tier under DIR/replica-<i>.")
    ] = None,
    api_keys: Annotated[
        Path | None,
        typer.Option("--api-keys", help="Key file, passed to every replica and checked by the router."),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Let the router listen on a non-loopback --host without API keys.",
        ),
    ] = False,
    max_connections: Annotated[
        int, typer.Option(min=1, help="The router's concurrent client connections before a 503.")
    ] = DEFAULT_MAX_CONNECTIONS,
    keep_warm: Annotated[
        Path | None, typer.Option("--keep-warm", help="Keep-warm policy file for the router.")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32 or bfloat16 (default: the replicas' own default).")
    ] = None,
    capacity: Annotated[str, typer.Option(help="Memory KV budget per replica.")] = "2GiB",
    tenant_capacity_share: TenantCapacityShare = None,
    ttl: Annotated[
        str, typer.Option(help="Default cache TTL: 300, 90s, 5m, 1h.")
    ] = f"{DEFAULTS.default_ttl_s:g}",
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for each replica to load.")] = 300.0,
    no_kv_events: Annotated[
        bool,
        typer.Option(
            "--no-kv-events",
            help="Do not wire the replicas' KV events to the router (with cache-aware, they are on "
            "by default: loopback PUB and replay sockets per replica).",
        ),
    ] = False,
    router: Annotated[
        str,
        typer.Option(
            callback=_check_router,
            help="The router in front: prefixcache (this project's, --policy), smg (SMG cache_aware) or "
            "vllm-router (kv_aware, fed the replicas' KV events); the last two come from "
            "pip install 'prefixcache\\[routers]'.",
        ),
    ] = "prefixcache",
    router_policy: Annotated[
        str | None,
        typer.Option(
            help="The policy of --router smg or vllm-router, in its own names (default: smg cache_aware, "
            "vllm-router kv_aware)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "warning",
) -> None:
    """Try scale-out on one machine: redis-server on a free port (temp dir, no persistence), N
    replicas on loopback sharing it (and one tenant-salt secret), and the router in front (this
    project's, SMG or vllm-router). Ctrl-C stops everything."""

    from prefixcache.kvevents.security import write_keypair
    from prefixcache.router import RouterConfig, create_router_app
    from prefixcache.router.kv_index import FeedSpec

    keys = router_keys(api_keys, host, allow_unauthenticated)
    external = router != "prefixcache"
    router_binary = ""
    if external:
        try:
            router_binary = find_router(router)
        except ValueError as e:
            typer.echo(f"prefixcache cluster: {e}", err=True)
            raise typer.Exit(2) from e
    duration(ttl)
    parse_bytes(capacity)
    if keep_warm is not None:
        input_file(keep_warm, "--keep-warm", "keep-warm policy file")
    free_port_or_fail(host, port)  # before any replica loads a model
    warm_keys = keepwarm_keys(keep_warm)
    start_own_redis = not no_redis and redis_url is None
    password = redis_password_from(redis_password_file) if start_own_redis else ""
    maxmemory = parse_bytes(redis_maxmemory)
    sigterm_as_interrupt()  # SIGTERM stops the children too (the finally below)
    procs: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.mkdtemp(prefix="prefixcache-cluster-")
    env = dict(os.environ)
    # One secret for all replicas; with --disk-cache the one kept there, so a restart is warm.
    env.setdefault("PREFIXCACHE_SALT_SECRET", cluster_secret(disk_cache))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // replicas)))
    try:
        if start_own_redis:
            binary = shutil.which("redis-server")
            if binary is None:
                raise typer.BadParameter(
                    "redis-server not found: install it (apt-get install redis-server), "
                    "pass --redis URL, or --no-redis"
                )
            proc, redis_url = start_redis(
                binary,
                tmp,
                maxmemory=maxmemory,
                policy=redis_maxmemory_policy,
                password=password,
            )
            procs.append(proc)
            redis_line = (
                f"{redacted_url(redis_url)} (started: maxmemory {redis_maxmemory}, {redis_maxmemory_policy})"
            )
        else:
            redis_line = "off" if no_redis or redis_url is None else redacted_url(redis_url)
        env.pop("PREFIXCACHE_REDIS_URL_FILE", None)  # the replicas get the one URL below, or none
        if redis_url and not no_redis:  # the URL may hold a password: the environment, not argv
            env["PREFIXCACHE_REDIS_URL"] = redis_url
        else:
            env.pop("PREFIXCACHE_REDIS_URL", None)
        urls: list[str] = []
        events = not no_kv_events and (router == "vllm-router" or (not external and policy == "cache-aware"))
        feeds: dict[str, FeedSpec] = {}
        curve = None
        if events:  # CURVE between the replicas' publishers and the router: other local users see nothing
            pub_key, _ = write_keypair(tmp, "publisher")
            router_key, router_pub = write_keypair(tmp, "router")
            curve = curve_client(Path(tmp) / "publisher.pub", router_key)
        for i in range(replicas):
            rp = free_port()
            cmd = [
                sys.executable,
                "-m",
                "prefixcache",
                "serve",
                "--port",
                str(rp),
                "--capacity",
                capacity,
                "--ttl",
                str(ttl),
                "--log-level",
                log_level,
            ]
            if model:
                cmd.insert(4, model)
            if dtype:
                cmd += ["--dtype", dtype]
            if tenant_capacity_share is not None:
                cmd += ["--tenant-capacity-share", f"{tenant_capacity_share:g}"]
            if redis_url and not no_redis and redis_sync_writes:
                cmd.append("--redis-sync-writes")
            if disk_cache:
                cmd += ["--disk-cache", str(disk_cache / f"replica-{i}")]
            if api_keys:
                cmd += ["--api-keys", str(api_keys)]
            if events:
                pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
                cmd += ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
                cmd += [
                    "--kv-events-curve-secret-file",
                    str(pub_key),
                    "--kv-events-curve-clients",
                    str(router_pub),
                ]
                feeds[f"http://127.0.0.1:{rp}"] = FeedSpec(pub, replay)
            procs.append(subprocess.Popen(cmd, env=env))
            urls.append(f"http://127.0.0.1:{rp}")
        for url, proc in zip(urls, procs[-replicas:], strict=True):
            wait_ready(url, proc, ready_timeout)
        if external:
            sources = [EventSource(u, f.endpoint, f.replay_endpoint) for u, f in feeds.items()]
            name = model_name_of(model)
            cmd = router_command(
                router, router_binary, urls, host=host, port=port, policy=router_policy, events=sources,
                model=name, log_level=log_level,
            )  # fmt: skip
            front = subprocess.Popen(cmd)
            procs.append(front)
            wait_models(f"http://{host}:{port}", front, ready_timeout)
            typer.echo(
                f"prefixcache cluster: {replicas} replicas {urls}, redis {redis_line}; {router} "
                f"({cmd[cmd.index('--policy') + 1]}{', KV events' if events else ''}) on "
                f"http://{host}:{port}. Ctrl-C stops all."
            )
            code = front.wait()
            raise RuntimeError(f"{router} exited with status {code} (see its log above)")
        typer.echo(
            f"prefixcache cluster: {replicas} replicas {urls}, redis {redis_line}; "
            f"router ({policy}{', KV events' if events else ''}) on http://{host}:{port}. Ctrl-C stops all."
        )
        config = RouterConfig(
            replicas=urls,
            policy=policy,
            keepwarm_file=str(keep_warm) if keep_warm else None,
            kv_events=feeds,
            api_keys=keys,
            kv_events_curve=curve,
        )
        router_security.serve_router(
            create_router_app(config),
            host=host,
            port=port,
            log_level=log_level,
            max_connections=max_connections,
            secrets=[*(keys or ()), *warm_keys],
        )
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        typer.echo(f"prefixcache cluster: {e}", err=True)
        raise typer.Exit(1) from e
    finally:
        _stop(procs[::-1])
        shutil.rmtree(tmp, ignore_errors=True)


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the root app."""
    app.command("route")(route)
    app.command("cluster")(cluster)
