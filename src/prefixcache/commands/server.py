"""CLI commands of the server layer: ``prefixcache serve``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"'{text}' is not a size; write e.g. 2GiB, 512MB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def serve(
    model: Annotated[
        str | None,
        typer.Argument(help="A GGUF file or Hugging Face model folder. Default: the embedded SmolLM2-135M-Instruct."),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            "--api-keys",
            help="Key file mapping API keys to tenants: a JSON object {\"key\": \"tenant\"} or 'key: tenant' "
            "lines. Without it there is one 'default' tenant and no authentication.",
        ),
    ] = None,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Generation requests in flight (running or waiting) before 429 / 529.")
    ] = 64,
    trace_log: Annotated[
        Path | None, typer.Option("--trace-log", help="Append one JSONL line per request (trace format v1).")
    ] = None,
    trace_text: Annotated[
        bool, typer.Option("--trace-text", help="Also write the prompt text into the trace log (default: ids only).")
    ] = False,
    ttl: Annotated[float, typer.Option(min=1.0, help="Default cache TTL in seconds (refreshed on every hit).")] = 300.0,
    capacity: Annotated[str, typer.Option(help="Byte budget of the KV cache, e.g. 2GiB or 512MB.")] = "2GiB",
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per cache block.")] = 16,
    prefill_chunk: Annotated[
        int | None,
        typer.Option(min=1, help="Prefill tokens per engine step (a multiple of the block size; with "
                     "--runner hf also the hit granularity). Default: 512."),
    ] = None,
    runner: Annotated[
        str, typer.Option(help="auto (the own batched runner for Llama-family models, else Hugging Face), "
                          "llama, or hf (the 0.1 runner: one request at a time, 512-token hit granularity).")
    ] = "auto",
    dtype: Annotated[
        str | None, typer.Option(help="Compute (and KV) dtype: float32 or bfloat16. Default: bfloat16 on CPUs "
                                 "with bf16 instructions and on CUDA, float32 elsewhere.")
    ] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Requests computed together in each engine step.")] = 16,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Compute threads (default: all cores).")
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="The model id clients must send. Default: the model's name.")
    ] = None,
    salt_secret: Annotated[
        str | None,
        typer.Option(
            envvar="PREFIXCACHE_SALT_SECRET",
            help="Secret for the per-tenant cache salts (replicas sharing a cache tier need the same). "
            "Default: random per process.",
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option("--redis", envvar="PREFIXCACHE_REDIS_URL",
                     help="Shared Redis tier, e.g. redis://127.0.0.1:6379/0: replicas share cached blocks."),
    ] = None,
    redis_sync_writes: Annotated[
        bool,
        typer.Option("--redis-sync-writes",
                     help="Write new blocks to Redis inside the commit (other replicas see them at once; "
                     "one round trip per new block)."),
    ] = False,
    disk_cache: Annotated[
        Path | None,
        typer.Option("--disk-cache", envvar="PREFIXCACHE_DISK_CACHE",
                     help="Disk tier directory: a restarted server is warm for what it persisted."),
    ] = None,
    disk_cache_size: Annotated[str, typer.Option(help="Disk tier byte budget, e.g. 8GiB.")] = "8GiB",
    log_level: Annotated[str, typer.Option(help="Log level: debug, info, warning, error.")] = "info",
) -> None:
    """Serve the engine over HTTP: OpenAI (/v1/chat/completions, /v1/completions) and Anthropic
    (/v1/messages) routes with prefix-cache usage, per-tenant isolation, /metrics and /health."""
    import logging

    import uvicorn

    from prefixcache.cache.tiers import attach_tiers, register_prometheus
    from prefixcache.engine import Engine
    from prefixcache.server import create_app
    from prefixcache.server.app import DEFAULT_MODEL_NAME
    from prefixcache.server.auth import load_api_keys

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keys = load_api_keys(api_keys) if api_keys else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-keys") from e
    capacity_bytes = parse_bytes(capacity)
    try:
        engine = Engine(
            model,
            block_size=block_size,
            prefill_chunk=prefill_chunk,
            runner=runner,
            dtype=dtype,
            capacity_bytes=capacity_bytes,
            default_ttl_s=ttl,
            max_queue=max_queue,
            max_batch=max_batch,
            threads=threads,
        )
    except ValueError as e:  # a missing model file, a bad chunk size or dtype: say which
        raise typer.BadParameter(str(e)) from e
    if engine.cache is not None:
        attach_tiers(
            engine.cache,
            disk_dir=disk_cache,
            disk_bytes=parse_bytes(disk_cache_size),
            redis_url=redis_url,
            redis_sync_writes=redis_sync_writes,
        )
    name = model_name or (DEFAULT_MODEL_NAME if model is None else Path(model).stem)
    app = create_app(
        engine,
        api_keys=keys,
        max_queue=max_queue,
        trace_log=trace_log,
        trace_text=trace_text,
        model_name=name,
        salt_secret=salt_secret,
        trace_tokenizer="default" if model is None else None,
    )
    if engine.cache is not None and engine.cache.tiers:
        register_prometheus(engine.cache, app.state.prefixcache.metrics.registry)
    tiers = ", ".join(t.name for t in engine.cache.tiers) if engine.cache is not None else ""
    typer.echo(f"prefixcache: cache tiers below memory: {tiers or 'none'}")
    typer.echo(f"prefixcache: serving '{name}' on http://{host}:{port} (OpenAI and Anthropic routes, /metrics)")
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
    finally:
        engine.close()


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the root app."""
    app.command("serve")(serve)
