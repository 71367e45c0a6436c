"""``prefixcache trace import``: public and foreign traces into the ops tools' format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def trace_import(
    src: Annotated[Path, typer.Argument(help="The trace to convert (JSONL; .gz is read too).")],
    out: Annotated[Path, typer.Argument(help="Where to write the trace (JSONL v1; overwritten).")],
    from_format: Annotated[
        str,
        typer.Option(
            "--from",
            help="Its format: mooncake (FAST'25 hash_ids, 512-token blocks), qwen-bailian (hash_ids, "
            "16-token blocks), openai (Chat Completions bodies), anthropic (Messages bodies), "
            "trace-log (this server's --trace-log).",
        ),
    ],
    timestamp_field: Annotated[
        str,
        typer.Option(help="openai/anthropic: the field of each line holding its time (seconds or ISO 8601)."),
    ] = "timestamp",
    interval_ms: Annotated[
        float | None,
        typer.Option(
            help="openai/anthropic: space the requests this many ms apart when lines carry no time."
        ),
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Label every request with this tenant.")] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(help="Label every request with this endpoint (default: the format's own labels)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="openai/anthropic: the tokenizer the header names (default: SmolLM2's when read)."),
    ] = None,
) -> None:
    """Convert a public or foreign trace so that `audit` and `simulate` read it (docs/ops.md)."""
    from rich.console import Console

    from prefixcache.analysis.trace import TraceFormatError
    from prefixcache.analysis.trace.importers import FORMATS, import_trace
    from prefixcache.commands.progress import progress

    if from_format not in FORMATS:
        raise typer.BadParameter(f"choose one of {', '.join(FORMATS)}", param_hint="--from")
    if not src.is_file():
        raise typer.BadParameter(f"no such file: {src}", param_hint="SRC")
    with progress() as prog:
        task = prog.add_task(f"importing {src.name}", total=None)
        try:
            res = import_trace(
                from_format,
                src,
                out,
                timestamp_field=timestamp_field,
                interval_ms=interval_ms,
                tenant=tenant,
                endpoint=endpoint,
                tokenizer=tokenizer,
                progress=lambda done, total: prog.update(task, completed=done, total=total or None),
            )
        except TraceFormatError as exc:
            raise typer.BadParameter(str(exc), param_hint="SRC") from None
    blocks = f", {res.block_size}-token blocks" if res.block_size else ""
    text = "" if res.token_text else " (block hashes, no token text: the audit says what it cannot find)"
    Console().print(f"wrote {res.requests:,} requests to {out}{blocks}{text}")


def register(trace_app: typer.Typer) -> None:
    trace_app.command("import")(trace_import)
