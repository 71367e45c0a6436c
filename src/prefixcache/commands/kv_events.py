"""The KV event flags of ``prefixcache serve`` (``--kv-events-*``): their declarations, and the
publisher they open (bound before the model loads) and attach (once the app exists)."""

from __future__ import annotations

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


def open_publisher(
    endpoint: str | None, replay: str | None, topic: str, buffer: int, hash_format: str
) -> Any:
    """The bound KV event publisher, or None without ``--kv-events-endpoint`` (typer errors that
    say what to fix)."""
    from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
    from prefixcache.kvevents.wire import HashFormat

    if endpoint is None:
        if replay is not None:
            raise typer.BadParameter(
                "a replay endpoint needs --kv-events-endpoint too", param_hint="--kv-events-replay-endpoint"
            )
        return None
    if hash_format not in ("int", "bytes"):
        raise typer.BadParameter(f"'{hash_format}' is not int or bytes", param_hint="--kv-events-hash-format")
    try:
        return KVEventPublisher(
            PublisherConfig(endpoint, replay, topic, buffer, hash_format=HashFormat(hash_format))
        )
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kv-events-endpoint") from e


def attach(app: Any, engine: Any, publisher: Any) -> None:
    """Publish the engine cache's events (``medium`` from the engine's device)."""
    from prefixcache.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU
    from prefixcache.server.kv_blocks import enable_kv_events

    device = getattr(getattr(engine, "runner", None), "device", "cpu")
    publisher.config.medium = MEDIUM_GPU if getattr(device, "type", str(device)) == "cuda" else MEDIUM_CPU
    try:
        enable_kv_events(app, publisher)
    except ValueError as e:
        publisher.close()
        engine.close()
        raise typer.BadParameter(str(e), param_hint="--kv-events-endpoint") from e
    config = publisher.config
    replay_note = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
    typer.echo(
        f"prefixcache: KV events on {publisher.endpoint}{replay_note} "
        f"({config.hash_format.value} hashes, {config.medium})"
    )
