"""CLI commands of the server layer: ``prefixcache serve``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cache.config import DEFAULTS
from prefixcache.cache.tiers import DEFAULT_DISK_BYTES, DEFAULT_MAX_TTL_S
from prefixcache.commands import kv_events as kv
from prefixcache.commands.options import duration, free_port_or_fail
from prefixcache.commands.serve_secrets import redis_url_of, secrets_of
from prefixcache.commands.warm import disk_secret, warn_stale
from prefixcache.engine.config import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_VERIFY_RATE

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"'{text}' is not a size; write e.g. 2GiB, 512MB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


#: ``--tenant-capacity-share``, the same option on ``serve`` and ``cluster`` (which passes it on).
TenantCapacityShare = Annotated[
    float | None,
    typer.Option(
        min=0.01,
        max=1.0,
        help="With two tenants or more, the share of the cache's capacity past which a tenant's "
        "inserts evict its own blocks first (not the others' warm prefixes). Default: one LRU.",
    ),
]


def serve(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            help="A GGUF file or Hugging Face model folder. Default: the embedded SmolLM2-135M-Instruct."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            "--api-keys",
            envvar="PREFIXCACHE_API_KEYS_FILE",
            help='Key file mapping API keys to tenants: a JSON object {"key": "tenant"} or \'key: tenant\' '
            "lines (or the same text in $PREFIXCACHE_API_KEYS). Without keys there is one 'default' tenant "
            "and no authentication, which only a loopback --host allows by default.",
        ),
    ] = None,
    admin_tenant: Annotated[
        list[str] | None,
        typer.Option(
            "--admin-tenant",
            help="A tenant of the key file whose keys see every tenant's prefixes on the dashboard "
            "(GET /dashboard); other keys see their own tenant's. Repeat for several.",
        ),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            "--allow-unauthenticated",
            help="Serve on a non-loopback --host without API keys (every client that can reach it "
            "is trusted: cached_tokens tells a caller what others sent).",
        ),
    ] = False,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Generation requests in flight (running or waiting) before 429 / 529.")
    ] = DEFAULT_MAX_QUEUE,
    tier_encrypt: Annotated[
        bool,
        typer.Option(
            "--tier-encrypt",
            help="Encrypt the entries written to the disk and Redis tiers (ChaCha20-Poly1305, keyed from "
            "the salt secret; needs the 'cryptography' package). Entries otherwise hold token ids in clear.",
        ),
    ] = False,
    max_connections: Annotated[
        int,
        typer.Option(
            min=1,
            help="Concurrent client connections (and requests) before new ones get a 503 (idle "
            "keep-alive connections count).",
        ),
    ] = 1024,
    tenant_queue_share: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=1.0,
            help="With two tenants or more, the share of --max-queue one tenant may hold (then 429).",
        ),
    ] = 0.5,
    tenant_pin_share: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=1.0,
            help="With two tenants or more, the share of the pinned (keep-warm) budget one tenant may "
            "hold (then POST /v1/cache/pin answers 409).",
        ),
    ] = 0.5,
    tenant_capacity_share: TenantCapacityShare = None,
    max_body_bytes: Annotated[
        str | None,
        typer.Option(
            help="Largest request body (413 beyond, before parsing), e.g. 8MiB. Default: 8 MiB, or "
            "32 bytes per context token for longer contexts."
        ),
    ] = None,
    trace_log: Annotated[
        Path | None,
        typer.Option(
            "--trace-log", help="Append one JSONL line per request (trace format v1); created 0600."
        ),
    ] = None,
    trace_text: Annotated[
        bool,
        typer.Option(
            "--trace-text", help="Also write the prompt text into the trace log (default: ids only)."
        ),
    ] = False,
    trace_keys_only: Annotated[
        bool,
        typer.Option(
            "--trace-keys-only",
            help="Privacy mode: write salted block keys instead of token ids (no prompt content); "
            "audit and simulate still replay the trace.",
        ),
    ] = False,
    busting_window: Annotated[
        int,
        typer.Option(
            min=0,
            help="Requests per endpoint the live cache-busting watch compares (GET /v1/cache/report, "
            "a log warning and prefixcache_cache_busting_findings_total per finding); 0 turns it off.",
        ),
    ] = 32,
    ttl: Annotated[
        str, typer.Option(help="Default cache TTL (refreshed on every hit): 300, 90s, 5m, 1h.")
    ] = f"{DEFAULTS.default_ttl_s:g}",
    capacity: Annotated[
        str, typer.Option(help="Byte budget of the KV cache, e.g. 2GiB or 512MB.")
    ] = f"{DEFAULTS.capacity_bytes >> 30}GiB",
    reasons_bytes: Annotated[
        str,
        typer.Option(
            help="Memory, out of --capacity, for explaining cache misses (recently removed blocks and "
            "each tenant's recent prompts; at most an eighth of --capacity). 0 turns the record off: "
            "expired, evicted and flushed blocks then read as new_prefix.",
        ),
    ] = f"{DEFAULTS.reasons_bytes >> 20}MiB",
    miss_reasons: Annotated[
        bool,
        typer.Option(
            help="Tell every answer why its cache read ended where it did (the prefixcache object, "
            "Anthropic's diagnostics, the miss metrics). --no-miss-reasons: a benchmark's baseline.",
        ),
    ] = True,
    verify_rate: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Share of cache hits the exactness audit recomputes with the cache bypassed, in spare "
            "step capacity, comparing logits and KV bit for bit (prefixcache_cache_verified_total; a "
            "difference removes the blocks and marks /health degraded). 0 turns it off.",
        ),
    ] = DEFAULT_VERIFY_RATE,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per cache block.")] = DEFAULTS.block_size,
    prefill_chunk: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Prefill tokens per engine step (a multiple of the block size; with "
            "--runner hf also the hit granularity). Default: 512.",
        ),
    ] = None,
    runner: Annotated[
        str,
        typer.Option(
            help="auto (the own batched runner for Llama-family models, else Hugging Face), "
            "llama, or hf (the 0.1 runner: one request at a time, 512-token hit granularity)."
        ),
    ] = "auto",
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Compute (and KV) dtype: float32 or bfloat16. Default: $PREFIXCACHE_DTYPE when set, "
            "else bfloat16 on CPUs with bf16 instructions and on CUDA, float32 elsewhere."
        ),
    ] = None,
    weights: Annotated[
        str,
        typer.Option(
            help="auto (the default: q4 where it computes the float model's bits, else float), "
            "float (the model's weights in the compute dtype), q4 (the GGUF's 4-bit Q4_1 groups "
            "read in place: a quarter of the bytes a decode step reads) or q4a8 (q4 with decode "
            "rows in 8 bits a group, as llama.cpp computes Q4_1: faster single streams, another "
            "model numerically with its own cache namespace; see docs/engine.md)."
        ),
    ] = "auto",
    max_batch: Annotated[
        int, typer.Option(min=1, help="Requests computed together in each engine step.")
    ] = DEFAULT_MAX_BATCH,
    threads: Annotated[int | None, typer.Option(min=1, help="Compute threads (default: all cores).")] = None,
    model_name: Annotated[
        str | None, typer.Option(help="The model id clients must send. Default: the model's name.")
    ] = None,
    salt_secret: Annotated[
        str | None,
        typer.Option(
            envvar="PREFIXCACHE_SALT_SECRET",
            help="Secret for the per-tenant cache salts (replicas sharing a cache tier need the same). "
            "Default: with --disk-cache the one kept in DIR/salt-secret, else random per process. "
            "Prefer the environment or --salt-secret-file: argv is visible "
            "to every local user.",
        ),
    ] = None,
    salt_secret_file: Annotated[
        Path | None,
        typer.Option(
            "--salt-secret-file",
            envvar="PREFIXCACHE_SALT_SECRET_FILE",
            help="Read the salt secret from this file (its first line's text).",
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis",
            envvar="PREFIXCACHE_REDIS_URL",
            help="Shared Redis tier, e.g. redis://127.0.0.1:6379/0: replicas share cached blocks. A URL "
            "with a password belongs in $PREFIXCACHE_REDIS_URL or --redis-url-file (argv is visible to "
            "every local user).",
        ),
    ] = None,
    redis_url_file: Annotated[
        Path | None,
        typer.Option(
            "--redis-url-file",
            envvar="PREFIXCACHE_REDIS_URL_FILE",
            help="Read the Redis URL (which may hold a password) from this file (its first line's text).",
        ),
    ] = None,
    redis_max_ttl: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Longest expiry of a Redis entry in seconds, whatever TTL a request asks for "
            "(bounds what one client can keep in the shared Redis).",
        ),
    ] = DEFAULT_MAX_TTL_S,
    redis_sync_writes: Annotated[
        bool,
        typer.Option(
            "--redis-sync-writes",
            help="Write new blocks to Redis inside the commit (other replicas see them at once; "
            "one round trip per new block).",
        ),
    ] = False,
    disk_cache: Annotated[
        Path | None,
        typer.Option(
            "--disk-cache",
            envvar="PREFIXCACHE_DISK_CACHE",
            help="Disk tier directory: a restarted server is warm for what it persisted (without a "
            "given salt secret, one is kept in DIR/salt-secret, created 0600).",
        ),
    ] = None,
    disk_cache_size: Annotated[
        str, typer.Option(help="Disk tier byte budget, e.g. 8GiB.")
    ] = f"{DEFAULT_DISK_BYTES >> 30}GiB",
    kv_events_endpoint: kv.Endpoint = None,
    kv_events_replay_endpoint: kv.ReplayEndpoint = None,
    kv_events_topic: kv.Topic = "",
    kv_events_buffer: kv.Buffer = 10_000,
    kv_events_hash_format: kv.HashFormatOption = "int",
    kv_events_curve_secret_file: kv.CurveSecretFile = None,
    kv_events_curve_clients: kv.CurveClients = None,
    kv_events_allow_unauthenticated: kv.AllowUnauthenticated = False,
    log_level: Annotated[str, typer.Option(help="Log level: debug, info, warning, error.")] = "info",
) -> None:
    """Serve the engine over HTTP: OpenAI (/v1/chat/completions, /v1/completions) and Anthropic
    (/v1/messages) routes with prefix-cache usage, per-tenant isolation, /metrics and /health."""
    import logging

    from prefixcache.cache.tiers import DiskTier
    from prefixcache.commands.lifecycle import sigterm_as_interrupt
    from prefixcache.engine.config import EngineConfig
    from prefixcache.server.app import DEFAULT_MODEL_NAME
    from prefixcache.server.auth import resolve_secret
    from prefixcache.server.build import (
        AppConfig,
        BuildError,
        KVEventsConfig,
        ServerConfig,
        TierConfig,
        build_server,
    )
    from prefixcache.server.exposure import (
        RedactSecrets,
        exposure_refusal,
        install_redaction,
        is_loopback,
        redis_password,
    )

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = ctx.get_parameter_source("salt_secret")
    keys, salt_secret = secrets_of(
        api_keys,
        salt_secret,
        salt_secret_file,
        salt_on_argv=source is not None and source.name == "COMMANDLINE",
    )
    redis_source = ctx.get_parameter_source("redis_url")
    redis_url = redis_url_of(
        redis_url, redis_url_file, on_argv=redis_source is not None and redis_source.name == "COMMANDLINE"
    )
    # One secret for the tenant salts and the tier entries' MAC key: the one given, else the disk
    # tier's persisted one (a restart stays warm), else random per process.
    salt_secret = disk_secret(disk_cache, salt_secret, redis_url)
    secret = resolve_secret(salt_secret)
    # No secret reaches a log: the tiers log their Redis URL, exceptions may quote a header.
    secrets = [*(keys or {}), salt_secret or "", redis_password(redis_url) or ""]
    redactor = install_redaction(RedactSecrets(secrets))
    refusal = exposure_refusal(host, keys is not None, allow_unauthenticated)
    if refusal is not None:  # before the model loads: nothing is served
        typer.echo(f"prefixcache: {refusal}", err=True)
        raise typer.Exit(2)
    if admin_tenant and keys is None:
        raise typer.BadParameter(
            "an admin tenant needs API keys: add --api-keys FILE", param_hint="--admin-tenant"
        )
    if admin_tenant and keys is not None and not set(admin_tenant) <= set(keys.values()):
        missing = sorted(set(admin_tenant) - set(keys.values()))[0]
        raise typer.BadParameter(f"'{missing}' is not a tenant of the key file", param_hint="--admin-tenant")
    if trace_text and trace_keys_only:
        raise typer.BadParameter(
            "--trace-keys-only writes no prompt content: drop --trace-text", param_hint="--trace-keys-only"
        )
    ttl_s = duration(ttl)
    if ttl_s < 1.0:
        raise typer.BadParameter(f"{ttl!r} is shorter than a second", param_hint="--ttl")
    # Bound before the model loads: a taken port or a bad address fails at once.
    free_port_or_fail(host, port)
    capacity_bytes = parse_bytes(capacity)
    config = ServerConfig(
        model=model,
        engine=EngineConfig(
            block_size=block_size,
            prefill_chunk=prefill_chunk,
            runner=runner,
            dtype=dtype,
            weights=weights,
            capacity_bytes=capacity_bytes,
            reasons_bytes=min(parse_bytes(reasons_bytes), capacity_bytes // 8),
            miss_reasons=miss_reasons,
            verify_rate=verify_rate,
            default_ttl_s=ttl_s,
            max_queue=max_queue,
            max_batch=max_batch,
            threads=threads,
        ),
        tiers=TierConfig(
            disk_dir=disk_cache,
            disk_bytes=parse_bytes(disk_cache_size),
            redis_url=redis_url,
            redis_max_ttl_s=redis_max_ttl,
            redis_sync_writes=redis_sync_writes,
            encrypt=tier_encrypt,
        ),
        app=AppConfig(
            api_keys=keys,
            trace_log=trace_log,
            trace_text=trace_text,
            model_name=model_name or (DEFAULT_MODEL_NAME if model is None else Path(model).stem),
            salt_secret=secret,
            trace_tokenizer="default" if model is None else None,
            trace_keys_only=trace_keys_only,
            max_body_bytes=parse_bytes(max_body_bytes) if max_body_bytes else None,
            tenant_queue_share=tenant_queue_share,
            tenant_pin_share=tenant_pin_share,
            tenant_capacity_share=tenant_capacity_share,
            busting_window=busting_window,
            admin_tenants=tuple(admin_tenant or ()),
            # No keys on an exposed address: nothing tells callers apart, so no cached-side text.
            caller_text="none" if keys is None and not is_loopback(host) else None,
        ),
        kv_events=KVEventsConfig(
            endpoint=kv_events_endpoint,
            replay_endpoint=kv_events_replay_endpoint,
            topic=kv_events_topic,
            buffer=kv_events_buffer,
            hash_format=kv_events_hash_format,
            curve_secret_file=kv_events_curve_secret_file,
            curve_clients=kv_events_curve_clients,
            allow_unauthenticated=kv_events_allow_unauthenticated,
        ),
        host=host,
        port=port,
        max_connections=max_connections,
        log_level=log_level,
    )
    try:
        server = build_server(config)
    except BuildError as e:
        raise typer.BadParameter(str(e), param_hint=e.option) from e
    if server.engine.cache is not None:
        for tier in server.engine.cache.tiers:
            if isinstance(tier, DiskTier):
                warn_stale(tier)
    for line in server.describe():
        typer.echo(f"prefixcache: {line}")
    sigterm_as_interrupt()
    try:
        server.run(after_logging=lambda: install_redaction(redactor))  # uvicorn's handlers too
    finally:
        server.close()
    if not server.started:
        raise typer.Exit(3)  # uvicorn's startup failure (the port in use, ...) is logged above


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the root app."""
    app.command("serve")(serve)
