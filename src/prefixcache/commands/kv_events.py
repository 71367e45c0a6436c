"""The KV event flags of ``prefixcache serve`` (``--kv-events-*``): their declarations, and the
publisher they open (bound before the model loads) and attach (once the app exists)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

Endpoint = Annotated[
    str | None,
    typer.Option(
        "--kv-events-endpoint",
        help="Publish KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) in vLLM's "
        "format on a ZeroMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557.",
    ),
]
ReplayEndpoint = Annotated[
    str | None,
    typer.Option(
        "--kv-events-replay-endpoint",
        help="Also bind a ROUTER socket here that replays buffered event batches from a "
        "sequence number (vLLM's replay protocol), e.g. tcp://127.0.0.1:5558.",
    ),
]
Topic = Annotated[str, typer.Option("--kv-events-topic", help="Topic frame of every KV event message.")]
Buffer = Annotated[int, typer.Option("--kv-events-buffer", min=1, help="Event batches kept for replay.")]
HashFormatOption = Annotated[
    str,
    typer.Option(
        "--kv-events-hash-format",
        help="Block hashes on the wire: int (low 64 bits of the key, vLLM's default) or bytes "
        "(the whole 32-byte key).",
    ),
]


CurveSecretFile = Annotated[
    Path | None,
    typer.Option(
        "--kv-events-curve-secret-file",
        help="Encrypt and authenticate the KV event sockets with ZeroMQ CURVE: this file holds the "
        "publisher's secret key (Z85, mode 0600; `prefixcache kv-keys DIR` makes a pair).",
    ),
]
CurveClients = Annotated[
    Path | None,
    typer.Option(
        "--kv-events-curve-clients",
        help="With CURVE: the public keys allowed to subscribe or replay (a file, one key a line, or "
        "a folder of *.pub files: the routers' keys).",
    ),
]
AllowUnauthenticated = Annotated[
    bool,
    typer.Option(
        "--kv-events-allow-unauthenticated",
        help="Bind the KV event sockets on a non-loopback address without CURVE (the events carry "
        "every tenant's prompt token ids: only where every host that can connect is trusted).",
    ),
]


def curve_keys(secret_file: Path | None, clients: Path | None) -> tuple[bytes | None, frozenset[bytes]]:
    """(the publisher's secret key, the admitted client keys) from the CURVE flags."""
    from prefixcache.kvevents.security import read_public_keys, read_secret_key

    if secret_file is None:
        if clients is not None:
            raise typer.BadParameter(
                "client keys need --kv-events-curve-secret-file too", param_hint="--kv-events-curve-clients"
            )
        return None, frozenset()
    if clients is None:
        raise typer.BadParameter(
            "CURVE needs the routers' public keys: add --kv-events-curve-clients FILE",
            param_hint="--kv-events-curve-secret-file",
        )
    try:
        _, secret = read_secret_key(secret_file)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events-curve-secret-file") from e
    try:
        return secret, read_public_keys(clients)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events-curve-clients") from e


def open_publisher(
    endpoint: str | None,
    replay: str | None,
    topic: str,
    buffer: int,
    hash_format: str,
    *,
    curve_secret_file: Path | None = None,
    curve_clients: Path | None = None,
    allow_unauthenticated: bool = False,
) -> Any:
    """The bound KV event publisher, or None without ``--kv-events-endpoint`` (typer errors that
    say what to fix). A non-loopback address needs CURVE or ``--kv-events-allow-unauthenticated``."""
    from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
    from prefixcache.kvevents.security import exposure_refusal
    from prefixcache.kvevents.wire import HashFormat

    if endpoint is None:
        if replay is not None:
            raise typer.BadParameter(
                "a replay endpoint needs --kv-events-endpoint too", param_hint="--kv-events-replay-endpoint"
            )
        return None
    if hash_format not in ("int", "bytes"):
        raise typer.BadParameter(f"'{hash_format}' is not int or bytes", param_hint="--kv-events-hash-format")
    secret, clients = curve_keys(curve_secret_file, curve_clients)
    refusal = exposure_refusal((endpoint, replay), secret is not None, allow_unauthenticated)
    if refusal is not None:
        raise typer.BadParameter(refusal, param_hint="--kv-events-endpoint")
    try:
        return KVEventPublisher(
            PublisherConfig(
                endpoint,
                replay,
                topic,
                buffer,
                hash_format=HashFormat(hash_format),
                curve_secret=secret,
                curve_clients=clients,
            )
        )
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events-endpoint") from e


def kv_keys(
    folder: Annotated[Path, typer.Argument(help="Where to write NAME.key (secret, 0600) and NAME.pub.")],
    name: Annotated[str, typer.Option(help="The pair's file name (e.g. publisher, router).")] = "kv-events",
) -> None:
    """Make a ZeroMQ CURVE key pair for the KV event stream (serve's --kv-events-curve-*,
    route's --kv-events-curve-*)."""
    from prefixcache.kvevents.security import write_keypair

    key, pub = write_keypair(folder, name)
    typer.echo(f"prefixcache: wrote {key} (secret: keep it 0600) and {pub} (public)")


def register(app: typer.Typer) -> None:
    app.command("kv-keys")(kv_keys)
