"""The router's exposure and KV event security flags (``route`` and ``cluster``): its API keys
after ``serve``'s exposure rule, and the CURVE client options of its KV event feeds."""

from __future__ import annotations

from pathlib import Path

import typer


def curve_client(server_key: Path | None, secret_file: Path | None) -> dict[int, bytes] | None:
    """The feeds' CURVE client options from route's flags (None: both absent)."""
    from prefixcache.kvevents.security import client_options, read_public_keys, read_secret_key

    if server_key is None and secret_file is None:
        return None
    if server_key is None or secret_file is None:
        raise typer.BadParameter(
            "CURVE needs both --kv-events-curve-server-key and --kv-events-curve-secret-file",
            param_hint="--kv-events-curve-server-key"
            if server_key is None
            else "--kv-events-curve-secret-file",
        )
    try:
        [public] = read_public_keys(server_key)
        _, secret = read_secret_key(secret_file)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events-curve-*") from e
    return client_options(public, secret)


def router_keys(api_keys: Path | None, host: str, allow_unauthenticated: bool) -> frozenset[str] | None:
    """The router's keys (``--api-keys`` file, else ``$PREFIXCACHE_API_KEYS``), after the exposure
    rule of ``serve``: a non-loopback ``host`` without keys needs ``--allow-unauthenticated``."""
    from prefixcache.server.auth import load_api_keys
    from prefixcache.server.exposure import api_keys_from_env, exposure_refusal

    try:
        keys = load_api_keys(api_keys) if api_keys else api_keys_from_env()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-keys") from e
    refusal = exposure_refusal(host, keys is not None, allow_unauthenticated)
    if refusal is not None:
        raise typer.BadParameter(refusal, param_hint="--host")
    return frozenset(keys) if keys else None


def keepwarm_keys(path: Path | None) -> list[str]:
    """The API keys of a keep-warm policy (checked now: a bad policy, or one holding keys that
    other users can read, is a one-line error)."""
    from prefixcache.router.keepwarm import KeepWarm

    if path is None:
        return []
    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint="--keep-warm")
    try:
        policy = KeepWarm.load(path)
    except (ValueError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint="--keep-warm") from e
    return [p.api_key for p in policy.prefixes if p.api_key]


def serve_router(
    app: object, *, host: str, port: int, log_level: str, max_connections: int, secrets: list[str]
) -> None:
    """Run the router under uvicorn, every log handler redacting ``secrets`` (API keys)."""
    import uvicorn

    from prefixcache.server.exposure import RedactSecrets, install_redaction

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), limit_concurrency=max_connections
    )  # (uvicorn's handlers exist from here)
    install_redaction(RedactSecrets(secrets))
    uvicorn.Server(config).run()
