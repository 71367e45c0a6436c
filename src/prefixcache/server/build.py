"""``build_server(ServerConfig)``: the engine, its cache tiers, the app, the KV event stream and
their shutdown, wired in one library call (``prefixcache serve`` only maps its flags to the config).

    from prefixcache.server.build import KVEventsConfig, ServerConfig, TierConfig, build_server

    server = build_server(ServerConfig(port=8000, tiers=TierConfig(disk_dir="/var/cache/pc"),
                                       kv_events=KVEventsConfig(endpoint="tcp://127.0.0.1:5557")))
    try:
        server.run()          # uvicorn until Ctrl-C / SIGTERM
    finally:
        server.close()        # the publisher, the engine, then the tiers' queued writes

Every default has one home: the engine's in :class:`~prefixcache.engine.config.EngineConfig`, the
app's in :mod:`prefixcache.server.app`'s constants, the tiers' in
:func:`~prefixcache.cache.tiers.attach_tiers`. A setting that cannot be built raises
:class:`BuildError`, which names the option to fix (the CLI turns it into a usage error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.cache.tiers import (
    DEFAULT_DISK_BYTES,
    DEFAULT_MAX_TTL_S,
    attach_tiers,
    flush_tiers,
    register_prometheus,
)
from prefixcache.engine.config import EngineConfig
from prefixcache.server.app import (
    DEFAULT_MODEL_NAME,
    DEFAULT_TENANT_PIN_SHARE,
    DEFAULT_TENANT_QUEUE_SHARE,
    create_app,
)
from prefixcache.server.ops.busting import DEFAULT_WINDOW
from prefixcache.server.ops.dashboard import DEFAULT_INTERVAL_S

if TYPE_CHECKING:
    from fastapi import FastAPI

    from prefixcache.engine import Engine
    from prefixcache.engine.model import ModelRunner
    from prefixcache.kvevents.publisher import KVEventPublisher


class BuildError(ValueError):
    """A setting the server cannot be built with; ``option`` names the flag to fix (or None)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class TierConfig:
    """The cache tiers below memory (none by default). The entries' MAC key (and, with
    ``encrypt``, their key) derive from the app's ``salt_secret``."""

    disk_dir: str | os.PathLike[str] | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    redis_url: str | None = None
    redis_max_ttl_s: float = DEFAULT_MAX_TTL_S
    redis_sync_writes: bool = False
    encrypt: bool = False


@dataclass(frozen=True)
class AppConfig:
    """What :func:`~prefixcache.server.app.create_app` takes besides the engine (its docstring
    says what each does); the defaults are the app's own constants. The queue bound is the
    engine's ``max_queue`` (one setting for both)."""

    api_keys: Mapping[str, str] | None = None
    trace_log: str | Path | None = None
    trace_text: bool = False
    trace_keys_only: bool = False
    model_name: str = DEFAULT_MODEL_NAME
    salt_secret: str | bytes | None = None
    trace_tokenizer: str | None = None
    max_body_bytes: int | None = None
    tenant_queue_share: float = DEFAULT_TENANT_QUEUE_SHARE
    admin_tenants: Sequence[str] = ()
    dashboard_interval_s: float = DEFAULT_INTERVAL_S
    tenant_pin_share: float = DEFAULT_TENANT_PIN_SHARE
    tenant_capacity_share: float | None = None
    busting_window: int = DEFAULT_WINDOW
    caller_text: str | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """The KV event stream (vLLM's format on ZeroMQ; :mod:`prefixcache.kvevents.publisher`):
    off without an ``endpoint``. ``replay_endpoint``: a ROUTER socket replaying buffered batches
    (``buffer`` of them). ``hash_format``: ``"int"`` (the key's low 64 bits, vLLM's) or
    ``"bytes"``. A non-loopback address needs CURVE (``curve_secret_file``: the publisher's secret
    key; ``curve_clients``: the admitted public keys, a file or a folder of ``*.pub``) or
    ``allow_unauthenticated``: the events carry every tenant's prompt token ids."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    buffer: int = 10_000
    hash_format: str = "int"
    curve_secret_file: str | os.PathLike[str] | None = None
    curve_clients: str | os.PathLike[str] | None = None
    allow_unauthenticated: bool = False


@dataclass(frozen=True)
class ServerConfig:
    """One server: ``model`` (a .gguf path, an HF folder, a loaded runner, or None for the embedded
    SmolLM2), the engine, the tiers, the app and the KV event stream, and where uvicorn listens
    (``max_connections``: concurrent connections before uvicorn answers 503; None: no cap)."""

    model: str | os.PathLike[str] | ModelRunner | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    app: AppConfig = field(default_factory=AppConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    max_connections: int | None = None
    log_level: str = "info"


class Server:
    """A built server: ``engine``, ``app``, the KV event ``publisher`` (or None). :meth:`run`
    serves until interrupted; :meth:`close` releases everything (idempotent)."""

    def __init__(
        self, config: ServerConfig, engine: Engine, app: FastAPI, publisher: KVEventPublisher | None
    ) -> None:
        self.config = config
        self.engine = engine
        self.app = app
        self.publisher = publisher
        self.started = False
        self._closed = False

    def describe(self) -> list[str]:
        """The start-up lines: compute, tiers, KV events (if any), what is served where."""
        from prefixcache.engine.runtime import describe_runtime

        cache = self.engine.cache
        tiers = ", ".join(t.name for t in cache.tiers) if cache is not None else ""
        lines = [f"compute: {describe_runtime(self.engine)}", f"cache tiers below memory: {tiers or 'none'}"]
        pub = self.publisher
        if pub is not None:
            replay = f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ""
            how = f"{pub.config.hash_format.value} hashes, {pub.config.medium}"
            lines.append(f"KV events on {pub.endpoint}{replay} ({how})")
        c = self.config
        lines.append(
            f"serving '{c.app.model_name}' on http://{c.host}:{c.port} "
            "(OpenAI and Anthropic routes, /metrics, /dashboard)"
        )
        return lines

    def run(self, *, after_logging: Callable[[], object] | None = None) -> bool:
        """Serve under uvicorn until Ctrl-C (or a SIGTERM the caller maps to it); True when the
        server had started (False: uvicorn's start-up failed, logged). ``after_logging``: called
        once uvicorn has set up its log handlers (to install log filters on them)."""
        import uvicorn

        c = self.config
        config = uvicorn.Config(
            self.app,
            host=c.host,
            port=c.port,
            log_level=c.log_level.lower(),
            limit_concurrency=c.max_connections,
        )
        if after_logging is not None:
            after_logging()
        server = uvicorn.Server(config)
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        self.started = bool(server.started)
        return self.started

    def close(self) -> None:
        """Close the publisher and the engine, then wait for the tiers' queued writes (what a
        restart will find warm)."""
        if self._closed:
            return
        self._closed = True
        if self.publisher is not None:
            self.publisher.close()
        self.engine.close()
        cache = self.engine.cache
        if cache is not None and cache.tiers:
            flush_tiers(cache)


def build_server(config: ServerConfig) -> Server:
    """Bind the KV event sockets (before the model loads: a taken port fails at once), load the
    model into an engine, attach the tiers, build the app and wire the publisher to the cache.
    On a :class:`BuildError` everything made so far is closed, the publisher included."""
    from prefixcache.engine import Engine

    publisher = open_publisher(config.kv_events)
    try:
        engine = Engine(config.model, config=config.engine)
    except ValueError as e:  # a missing model file, a bad chunk size or dtype: say which
        if publisher is not None:
            publisher.close()
        raise BuildError(str(e)) from e
    try:
        _attach(engine, config.tiers, config.app.salt_secret)
        options = {f.name: getattr(config.app, f.name) for f in dataclasses.fields(config.app)}
        app = create_app(engine, max_queue=config.engine.max_queue, **options)
        if engine.cache is not None and engine.cache.tiers:
            register_prometheus(engine.cache, app.state.prefixcache.metrics.registry)
        if publisher is not None:
            _publish(app, engine, publisher)
    except BaseException:
        if publisher is not None:
            publisher.close()
        engine.close()
        raise
    return Server(config, engine, app, publisher)


def open_publisher(kv: KVEventsConfig) -> KVEventPublisher | None:
    """The bound KV event publisher, or None without an endpoint. Raises :class:`BuildError`
    naming the ``serve`` flag to fix: a replay endpoint alone, an unknown hash format, unreadable
    or missing CURVE keys, a non-loopback address without CURVE or ``allow_unauthenticated``, an
    address that cannot be bound."""
    if kv.endpoint is None:
        if kv.replay_endpoint is not None:
            message = "a replay endpoint needs --kv-events-endpoint too"
            raise BuildError(message, "--kv-events-replay-endpoint")
        return None
    from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
    from prefixcache.kvevents.security import exposure_refusal
    from prefixcache.kvevents.wire import HashFormat

    if kv.hash_format not in ("int", "bytes"):
        raise BuildError(f"'{kv.hash_format}' is not int or bytes", "--kv-events-hash-format")
    secret, clients = _curve_keys(kv.curve_secret_file, kv.curve_clients)
    endpoints = (kv.endpoint, kv.replay_endpoint)
    refusal = exposure_refusal(endpoints, secret is not None, kv.allow_unauthenticated)
    if refusal is not None:
        raise BuildError(refusal, "--kv-events-endpoint")
    try:
        return KVEventPublisher(
            PublisherConfig(
                kv.endpoint,
                kv.replay_endpoint,
                kv.topic,
                kv.buffer,
                hash_format=HashFormat(kv.hash_format),
                curve_secret=secret,
                curve_clients=clients,
            )
        )
    except ValueError as e:
        raise BuildError(str(e), "--kv-events-endpoint") from e


def _curve_keys(
    secret_file: str | os.PathLike[str] | None, clients: str | os.PathLike[str] | None
) -> tuple[bytes | None, frozenset[bytes]]:
    """(the publisher's secret key, the admitted client keys) from the CURVE settings."""
    from prefixcache.kvevents.security import read_public_keys, read_secret_key

    if secret_file is None:
        if clients is not None:
            message = "client keys need --kv-events-curve-secret-file too"
            raise BuildError(message, "--kv-events-curve-clients")
        return None, frozenset()
    if clients is None:
        raise BuildError(
            "CURVE needs the routers' public keys: add --kv-events-curve-clients FILE",
            "--kv-events-curve-secret-file",
        )
    try:
        _, secret = read_secret_key(secret_file)
    except ValueError as e:
        raise BuildError(str(e), "--kv-events-curve-secret-file") from e
    try:
        return secret, read_public_keys(clients)
    except ValueError as e:
        raise BuildError(str(e), "--kv-events-curve-clients") from e


def _attach(engine: Engine, tiers: TierConfig, secret: str | bytes | None) -> None:
    if engine.cache is None:
        return
    try:
        attach_tiers(
            engine.cache,
            secret=secret,
            redis_max_ttl_s=tiers.redis_max_ttl_s,
            disk_dir=tiers.disk_dir,
            disk_bytes=tiers.disk_bytes,
            redis_url=tiers.redis_url,
            redis_sync_writes=tiers.redis_sync_writes,
            encrypt=tiers.encrypt,
        )
    except ValueError as e:  # encryption without the cryptography package, or without a secret
        raise BuildError(str(e), "--tier-encrypt") from e


def _publish(app: FastAPI, engine: Engine, publisher: KVEventPublisher) -> None:
    from prefixcache.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU
    from prefixcache.server.compat.kv_blocks import enable_kv_events

    device = getattr(engine.runner, "device", "cpu")
    publisher.config.medium = MEDIUM_GPU if getattr(device, "type", str(device)) == "cuda" else MEDIUM_CPU
    try:
        enable_kv_events(app, publisher)
    except ValueError as e:
        raise BuildError(str(e), "--kv-events-endpoint") from e
