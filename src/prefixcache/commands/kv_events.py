"""The KV event flags of ``prefixcache serve`` (``--kv-events-*``): their declarations, which
``serve`` maps to :class:`~prefixcache.server.build.KVEventsConfig` (``build_server`` opens the
publisher), and ``prefixcache kv-keys``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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
