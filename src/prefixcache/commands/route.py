"""``prefixcache route``: the router in front of replicas given by URL (``cluster`` starts one
with its replicas).

Heavy imports (uvicorn, the router) happen inside the function so ``--help`` stays instant.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cache.config import DEFAULTS
from prefixcache.commands import router_security
from prefixcache.commands.lifecycle import sigterm_as_interrupt
from prefixcache.commands.options import free_port_or_fail, http_url, input_file
from prefixcache.commands.router_security import curve_client, keepwarm_keys, router_keys
from prefixcache.commands.server import parse_bytes
from prefixcache.routing import POLICIES  # one home: the router's and the simulator's names

#: ``--max-connections``' default (uvicorn answers 503 beyond it, before any route runs).
DEFAULT_MAX_CONNECTIONS = 1024


def check_policy(value: str) -> str:
    if value not in POLICIES:
        raise typer.BadParameter(f"'{value}' is not a policy; use one of: {', '.join(POLICIES)}")
    return value


def route(
    replica: Annotated[
        list[str],
        typer.Option(
            "--replica", "-r", help="Base URL of a replica, e.g. http://10.0.0.5:8000. Repeat per replica."
        ),
    ],
    policy: Annotated[
        str,
        typer.Option(
            callback=check_policy,
            help="prefix-affinity (hash of the prompt's leading part), cache-aware (track which replica "
            "holds which prefix), round-robin, least-loaded, random (seeded: what simulate models).",
        ),
    ] = "cache-aware",
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    health_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between GET /health rounds.")
    ] = 1.0,
    keep_warm: Annotated[
        Path | None,
        typer.Option(
            "--keep-warm", help="Keep-warm policy (JSON or YAML): prefixes pinned on every replica."
        ),
    ] = None,
    chunk_chars: Annotated[int, typer.Option(min=16, help="Characters per hashed prompt chunk.")] = 256,
    affinity_chars: Annotated[
        int, typer.Option(min=16, help="Leading characters that form the prefix-affinity key.")
    ] = 1024,
    load_factor: Annotated[
        float, typer.Option(help="Overload guard: go least-loaded when in-flight > factor * min + slack.")
    ] = 2.0,
    load_slack: Annotated[int, typer.Option(help="See --load-factor.")] = 4,
    record_ttl: Annotated[
        float, typer.Option(help="Seconds the router remembers where a prefix went.")
    ] = DEFAULTS.default_ttl_s,
    read_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Seconds a replica may stay silent (before its answer or between stream chunks) before "
            "the request fails with 504; a slow replica is not marked down and the request not retried.",
        ),
    ] = 600.0,
    max_body_bytes: Annotated[
        str, typer.Option(help="Largest request body (413 beyond, before it is read), e.g. 8MiB.")
    ] = "8MiB",
    kv_events: Annotated[
        list[str] | None,
        typer.Option(
            "--kv-events",
            help="A replica's KV event feed, REPLICA_URL=PUB_ENDPOINT[,REPLAY_ENDPOINT] (the replica's "
            "serve --kv-events-endpoint / --kv-events-replay-endpoint), e.g. "
            "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558. Repeat per replica; "
            "cache-aware only. Replicas without one are tracked by the approximate record.",
        ),
    ] = None,
    kv_events_curve_server_key: Annotated[
        Path | None,
        typer.Option(
            "--kv-events-curve-server-key",
            help="CURVE: the replicas' publisher public key (the file serve's "
            "--kv-events-curve-secret-file pairs with); needs --kv-events-curve-secret-file.",
        ),
    ] = None,
    kv_events_curve_secret_file: Annotated[
        Path | None,
        typer.Option(
            "--kv-events-curve-secret-file",
            help="CURVE: the router's secret key (mode 0600; its public key goes in the replicas' "
            "--kv-events-curve-clients).",
        ),
    ] = None,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            "--api-keys",
            envvar="PREFIXCACHE_API_KEYS_FILE",
            help="Key file (the replicas' format; or its text in $PREFIXCACHE_API_KEYS): only requests "
            "with one of its keys get past the router, checked before the body is read. Without keys "
            "only a loopback --host is allowed by default.",
        ),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Listen on a non-loopback --host without API keys (every client that can reach it is "
            "trusted).",
        ),
    ] = False,
    max_connections: Annotated[
        int,
        typer.Option(min=1, help="Concurrent client connections (and requests) before new ones get a 503."),
    ] = DEFAULT_MAX_CONNECTIONS,
    log_level: Annotated[str, typer.Option(help="Log level: debug, info, warning, error.")] = "info",
) -> None:
    """Route OpenAI and Anthropic requests across replicas so that requests sharing a prompt
    prefix land where it is cached (streaming relayed; fail-over when a replica dies; /metrics)."""
    import logging

    from prefixcache.router import RouterConfig, create_router_app
    from prefixcache.router.kv_index import parse_feed

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = router_keys(api_keys, host, allow_unauthenticated)
    replica = [http_url(r, "--replica") for r in replica]
    if keep_warm is not None:
        input_file(keep_warm, "--keep-warm", "keep-warm policy file")
    free_port_or_fail(host, port)
    secrets = [*(keys or ()), *keepwarm_keys(keep_warm)]
    feeds = {}
    for spec in kv_events or []:
        try:
            url, feed = parse_feed(spec)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--kv-events") from e
        feeds[url] = feed
    config = RouterConfig(
        replicas=replica,
        policy=policy,
        health_interval_s=health_interval,
        chunk_chars=chunk_chars,
        affinity_chars=affinity_chars,
        load_factor=load_factor,
        load_slack=load_slack,
        record_ttl_s=record_ttl,
        keepwarm_file=str(keep_warm) if keep_warm else None,
        read_timeout_s=read_timeout,
        max_body_bytes=parse_bytes(max_body_bytes),
        kv_events=feeds,
        api_keys=keys,
        kv_events_curve=curve_client(kv_events_curve_server_key, kv_events_curve_secret_file),
    )
    try:
        app = create_router_app(config)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events") from e
    events = f", KV events from {len(feeds)}" if feeds else ""
    typer.echo(f"prefixcache router: {policy} over {len(replica)} replicas{events} on http://{host}:{port}")
    sigterm_as_interrupt()
    with contextlib.suppress(KeyboardInterrupt):
        router_security.serve_router(
            app, host=host, port=port, log_level=log_level, max_connections=max_connections, secrets=secrets
        )
