"""CLI commands of the analysis layer: ``prefixcache trace synth``, ``audit`` and ``simulate``.

Heavy imports (numpy, matplotlib, the analysis modules) happen inside the functions, so
``--help`` stays instant.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixcache.analysis.report.tables import report_console
from prefixcache.commands.options import duration, input_file, output_file, size
from prefixcache.commands.progress import Stages, progress

if TYPE_CHECKING:
    from prefixcache.analysis.costs import CostModel
    from prefixcache.analysis.trace import Trace

log = logging.getLogger(__name__)

trace_app = typer.Typer(
    name="trace",
    help="Request traces: make synthetic ones, import public and foreign ones (format: docs/ops.md).",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


#: ``--format`` of the reports (audit, simulate).
ReportFormatOpt = Annotated[
    str,
    typer.Option(
        "--format", help="table (fits the terminal: wide tables are stacked), markdown, csv or json."
    ),
]


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise typer.BadParameter(f"no such trace file: {path}", param_hint="TRACE")


def _load(path: Path, tokenizer: str | None) -> Trace:
    from prefixcache.analysis.trace import TraceFormatError, count_lines, load_trace

    _check_file(path)
    prog = progress()
    total = count_lines(path) if not prog.disable else 0  # a bar's total: only when one is drawn
    with prog:
        task = prog.add_task(f"reading {path.name}", total=total or None)
        try:
            return load_trace(path, tokenizer=tokenizer, progress=lambda k: prog.update(task, completed=k))
        except TraceFormatError as exc:
            raise typer.BadParameter(str(exc), param_hint="TRACE") from None


@trace_app.command("synth")
def synth(
    out: Annotated[Path, typer.Argument(help="Output trace (JSONL; .gz compresses).")],
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            "--endpoint",
            "-e",
            help=(
                "Endpoint spec, repeatable: name:rate=2,system=1500,user=48,output=128,"
                "bust=timestamp|epoch|uuid|hex_id|counter (stacked: timestamp+counter),"
                "bust_at=top|middle|bottom,deploys=600;1800,turns=3,tenant=acme,"
                "arrival=poisson|bursty|diurnal. Default: a five-endpoint scenario "
                "(clean chat, timestamp at the top, uuid mid-prompt, deploys, a quiet one)."
            ),
        ),
    ] = None,
    requests: Annotated[
        int | None, typer.Option("--requests", "-n", min=1, help="Total requests (sets the duration).")
    ] = 10_000,
    duration: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds of traffic instead of --requests.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed: same seed and specs, same file.")] = 0,
    tokenizer: Annotated[
        str, typer.Option(help="bytes (one token per byte: instant), default (SmolLM2) or a folder.")
    ] = "bytes",
) -> None:
    """Write a seeded synthetic trace of the scenarios that make or break prompt caching."""
    from rich.console import Console

    from prefixcache.analysis.trace.synth import DEFAULT_SCENARIO, parse_endpoint, synthesize

    output_file(out, "OUT")
    try:
        specs = [parse_endpoint(s) for s in (endpoint or DEFAULT_SCENARIO)]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--endpoint") from None
    with progress() as prog:
        task = prog.add_task("synthesizing", total=requests)
        res = synthesize(
            out,
            specs,
            requests=None if duration else requests,
            duration_s=duration,
            seed=seed,
            tokenizer=tokenizer,
            progress=lambda k: prog.update(task, completed=k),
        )
    Console().print(f"wrote {res.requests:,} requests ({res.duration_s:,.0f} s of traffic) to {res.path}")
    for p in res.planted:
        Console().print(f"  planted: {p['kind']} in {p['endpoint']} at token {p['start_token']} ({p['at']})")


def audit(
    trace: Annotated[Path, typer.Argument(help="Trace file (JSONL v1).")],
    ttl: Annotated[str, typer.Option(help="Cache TTL: 300, 5m, 1h.")] = "300",
    html: Annotated[Path | None, typer.Option("--html", help="Write an HTML report with plots.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    fmt: ReportFormatOpt = "table",
    plots: Annotated[
        Path | None, typer.Option(help="Also save the plots as PNG files in this folder.")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer for text prompts and span decoding (default: the trace header's, else SmolLM2)."
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(min=1, help="Tokens per cache block (default: the trace header's block_size, else 16)."),
    ] = None,
    align: Annotated[
        int | None,
        typer.Option(min=1, help="Hits end on a multiple of this many tokens (the engine's prefill chunk)."),
    ] = None,
    pricing: Annotated[
        str, typer.Option(help="anthropic | openai | self-hosted: prices savings and keep-warm.")
    ] = "anthropic",
    min_shared: Annotated[
        int, typer.Option(min=0, help="A busting span must sit above at least this many shared tokens.")
    ] = 64,
) -> None:
    """Why the hit rate is what it is: cache-busting spans, prefix stability, TTL against traffic.

    Per endpoint: achieved and achievable hit rate, divergence points, variable spans (timestamp,
    uuid, hex_id, counter, other) above shared content with the tokens they cost, prefix versions,
    reuse gaps against the TTL and keep-warm candidates.
    """

    from prefixcache.analysis.audit import AuditConfig, audit_file
    from prefixcache.analysis.costs import PROFILES
    from prefixcache.analysis.report import audit_html, print_audit, save_audit_plots, to_json
    from prefixcache.analysis.trace import TraceFormatError

    json_out = _format(fmt, json_out)
    _check_file(trace)
    if pricing not in PROFILES:
        raise typer.BadParameter(f"{pricing!r}: choose from {', '.join(PROFILES)}", param_hint="--pricing")
    output_file(html, "--html")
    _check_folder(plots, "--plots")
    cfg = AuditConfig(
        ttl_s=duration(ttl),
        block_size=_block_size(trace, block_size),
        align_tokens=align,
        pricing=pricing,
        tokenizer=tokenizer,
        min_shared_tokens=min_shared,
    )
    with progress() as prog:
        try:
            res = audit_file(trace, cfg, tokenizer=tokenizer, progress=Stages(prog))
        except TraceFormatError as exc:
            raise typer.BadParameter(str(exc), param_hint="TRACE") from None
    console = report_console()
    if json_out:
        print(to_json(res.as_dict()))
    else:
        print_audit(res, console, fmt)
    if html:
        audit_html(res, html)
        console.print(f"HTML report: {html}", style="dim")
    if plots:
        for p in save_audit_plots(res, plots):
            console.print(f"plot: {p}", style="dim")


def simulate(
    trace: Annotated[Path, typer.Argument(help="Trace file (JSONL v1).")],
    ttl: Annotated[str, typer.Option(help="Cache TTL: 300, 5m, 1h.")] = "300",
    capacity: Annotated[str, typer.Option(help="Cache bytes per replica: 16GiB, 512MiB, inf.")] = "16GiB",
    block_size: Annotated[
        int | None,
        typer.Option(min=1, help="Tokens per cache block (default: the trace header's block_size, else 16)."),
    ] = None,
    align: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Hits end on a multiple of this many tokens and only complete chunks are stored "
            "(0.1's engine: 512). Default: the block size, as the engine does now.",
        ),
    ] = None,
    replicas: Annotated[int, typer.Option(min=1, help="Number of replicas, each with its own cache.")] = 1,
    routing: Annotated[
        str, typer.Option(help="round-robin | random | least-loaded | prefix-affinity | cache-aware")
    ] = "round-robin",
    keep_warm: Annotated[
        str | None,
        typer.Option(
            help="auto (the audit's candidates) or FILE (audit --json output, "
            "or lines endpoint=prefix_tokens)."
        ),
    ] = None,
    prefill_tps: Annotated[
        str | None,
        typer.Option(
            help="Prefill tokens/s per replica, or a hardware profile: smollm2-135m-cpu, "
            "smollm2-135m-cpu-hf, llama3-8b-h100-est (docs/ops.md says where each figure comes "
            "from). Default: the calibration (see --calibration)."
        ),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(
            help="Calibration written by `prefixcache bench`. Default: the one it left in "
            "~/.cache/prefixcache/calibration.json ($PREFIXCACHE_HOME), else the one shipped in the package "
            "(whatever the working directory)."
        ),
    ] = None,
    kv_bytes_per_token: Annotated[
        str | None,
        typer.Option(
            help="Cache bytes per token, or a model profile: smollm2-135m-cpu, llama3-8b, qwen2.5-7b, "
            "llama3-70b. Default: the trace header's (a server's trace log records its KV dtype and "
            "size), else the calibration's, else SmolLM2 float32 (46,080)."
        ),
    ] = None,
    pricing: Annotated[
        list[str] | None, typer.Option(help="Pricing profile(s), repeatable: anthropic, openai, self-hosted.")
    ] = None,
    gpu_hour: Annotated[float, typer.Option(min=0.0, help="self-hosted: dollars per GPU-hour.")] = 2.0,
    sweep: Annotated[
        str | None,
        typer.Option(help="ttl=60,300,900,3600 or capacity=1GiB,4GiB (also replicas=, block_size=)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    fmt: ReportFormatOpt = "table",
    plot: Annotated[Path | None, typer.Option(help="With --sweep: save the curve as PNG.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random routing.")] = 0,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer for text prompts.")] = None,
) -> None:
    """Replay a trace through the real PrefixCache on a simulated clock: hit rate, prefill, TTFT, cost.

    What-if: another TTL, capacity, block size, replica count and routing policy, or keep-warm.
    """

    from prefixcache.analysis.costs import PROFILES
    from prefixcache.analysis.report import plot_sweep, print_sim, print_sweep, save_png, to_json
    from prefixcache.analysis.simulate import ROUTINGS, SimConfig, load_keep_warm, simulate_file
    from prefixcache.analysis.simulate import simulate as run_sim
    from prefixcache.analysis.simulate import sweep as run_sweep
    from prefixcache.analysis.trace import TraceFormatError

    json_out = _format(fmt, json_out)
    if routing not in ROUTINGS:
        raise typer.BadParameter(f"choose one of {', '.join(ROUTINGS)}", param_hint="--routing")
    if plot and not sweep:
        raise typer.BadParameter(
            "--plot draws a sweep's curve: add --sweep ttl=60,300,900", param_hint="--plot"
        )
    profiles = tuple(pricing or PROFILES)
    for p in profiles:
        if p not in PROFILES:
            raise typer.BadParameter(f"{p!r}: choose from {', '.join(PROFILES)}", param_hint="--pricing")
    output_file(plot, "--plot", create_parents=True)
    if keep_warm and keep_warm != "auto":
        input_file(Path(keep_warm), "--keep-warm", "keep-warm file (auto, or audit --json output)")
    if calibration is not None:
        input_file(calibration, "--calibration", "calibration file")
    _check_file(trace)
    model = _cost_model(prefill_tps, kv_bytes_per_token, calibration, trace)
    block_size = _block_size(trace, block_size)
    sweep_spec = _sweep(sweep) if sweep else None
    cfg = SimConfig(
        ttl_s=duration(ttl),
        capacity_bytes=size(capacity),
        block_size=block_size,
        align_tokens=align,
        replicas=replicas,
        routing=routing,
        seed=seed,
        cost=model,
        pricing=profiles,
        gpu_hour=gpu_hour,
    )
    console = report_console(stderr=json_out)
    if not sweep and not keep_warm:
        # One run, streamed: a reader process parses the file while this one replays.
        _check_file(trace)
        with progress() as prog:
            try:
                results = [simulate_file(trace, cfg, tokenizer=tokenizer, progress=Stages(prog))]
            except TraceFormatError as exc:
                raise typer.BadParameter(str(exc), param_hint="TRACE") from None
        if json_out:
            print(to_json(results[0].as_dict()))
        else:
            print_sim(results[0], console, fmt)
        return
    tr = _load(trace, tokenizer)
    if keep_warm == "auto":
        from prefixcache.analysis.audit import AuditConfig
        from prefixcache.analysis.audit import audit as run_audit

        a = run_audit(
            tr, AuditConfig(ttl_s=cfg.ttl_s, block_size=block_size, align_tokens=align, replay=False)
        )
        cfg.keep_warm = {e["endpoint"]: e["keep_warm_prefix_tokens"] for e in a.endpoints if e["keep_warm"]}
        console.print(f"keep-warm (auto): {', '.join(cfg.keep_warm) or 'no endpoint qualifies'}")
    elif keep_warm:
        try:
            cfg.keep_warm = load_keep_warm(keep_warm, tr)
        except (ValueError, KeyError, TypeError) as exc:
            raise typer.BadParameter(f"{keep_warm}: {exc}", param_hint="--keep-warm") from None
    with progress() as prog:
        if sweep_spec is not None:
            name, raw, field, values = sweep_spec
            results = []
            for label, v in zip(raw, values, strict=True):
                task = prog.add_task(f"{name}={label}", total=len(tr))
                results.extend(
                    run_sweep(tr, cfg, field, [v], progress=lambda k, t=task: prog.update(t, completed=k))
                )
                prog.update(task, completed=len(tr))
        else:
            task = prog.add_task("simulating", total=len(tr))
            results = [run_sim(tr, cfg, progress=lambda k: prog.update(task, completed=k))]
    if json_out:
        out = [r.as_dict() for r in results]
        print(to_json({"sweep": sweep, "results": out} if sweep else out[0]))
    elif sweep:
        print_sweep(name, raw, results, console, fmt)
    else:
        print_sim(results[0], console, fmt)
    if plot:
        save_png(plot_sweep(name, raw, [float(v) for v in values], results), plot)
        console.print(f"plot: {plot}", style="dim")


def _sweep(spec: str) -> tuple[str, list[str], str, list[float]]:
    """``ttl=60,300`` -> (name, raw labels, SimConfig field, values); one clean error otherwise."""
    from prefixcache.analysis.simulate import parse_sweep

    try:
        name, raw = parse_sweep(spec)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--sweep") from None

    def count(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise typer.BadParameter(f"{name}={text!r}: write whole numbers from 1", param_hint="--sweep")
        return int(text)

    field, conv = {
        "ttl": ("ttl_s", lambda v: duration(v, "--sweep")),
        "capacity": ("capacity_bytes", lambda v: size(v, "--sweep")),
        "replicas": ("replicas", count),
        "block_size": ("block_size", count),
    }[name]
    return name, raw, field, [conv(v) for v in raw]


def _format(fmt: str, json_out: bool) -> bool:
    """Whether to print JSON (``--json`` or ``--format json``); a bad ``--format`` is refused."""
    from prefixcache.analysis.report.tables import FORMATS

    if fmt not in FORMATS:
        raise typer.BadParameter(f"{fmt!r}: choose one of {', '.join(FORMATS)}", param_hint="--format")
    return json_out or fmt == "json"


def _check_folder(path: Path | None, hint: str) -> None:
    """A folder the command writes into: created if missing; one clean error if it cannot be."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is a file, not a folder", param_hint=hint)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot create the folder {path}: {exc.strerror or exc}", param_hint=hint
        ) from None


def _block_size(trace: Path, given: int | None) -> int:
    from prefixcache.analysis.trace.importers import block_size_for

    try:
        return block_size_for(trace, given)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--block-size") from None


def _cost_model(
    prefill_tps: str | None, kv_bytes_per_token: str | None, calibration: Path | None, trace: Path
) -> CostModel:
    """The simulator's cost model from the two flags (numbers or profile names), the trace's
    header (the KV bytes per token a server recorded) and the calibration."""
    from dataclasses import replace

    from prefixcache.analysis import hardware
    from prefixcache.analysis.costs import cost_model
    from prefixcache.analysis.trace.importers import header_of

    model = cost_model(None, calibration)
    header = header_of(trace)
    kv = header.get("kv_bytes_per_token")
    if kv_bytes_per_token is None and isinstance(kv, int) and kv > 0:
        model = replace(model, kv_bytes_per_token=kv, kv_source=f"trace header ({header.get('dtype', '?')})")
    if prefill_tps is not None:
        try:
            rate, source = hardware.prefill_tps(prefill_tps)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--prefill-tps") from None
        model = replace(model, prefill_tps=rate, source=source)
    if kv_bytes_per_token is not None:
        try:
            kv = hardware.kv_bytes_per_token(kv_bytes_per_token)
            model = replace(model, kv_bytes_per_token=kv, kv_source="--kv-bytes-per-token")
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--kv-bytes-per-token") from None
    return model


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the root app."""
    from prefixcache.commands import trace_import

    trace_import.register(trace_app)
    app.add_typer(trace_app, name="trace")
    app.command("audit")(audit)
    app.command("simulate")(simulate)
