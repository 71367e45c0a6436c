"""CLI commands of the engine layer: ``generate``, ``demo``, ``bench``.

Heavy imports (torch, transformers) happen inside the functions so ``--help`` stays instant.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="A .gguf file or Hugging Face model folder (default: embedded SmolLM2-135M-Instruct).",
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        help="Compute dtype: float32 or bfloat16 (default: $PREFIXCACHE_DTYPE when set, else bfloat16 on "
        "CPUs with bf16 instructions and on CUDA, else float32; the hf runner: float32)."
    ),
]
WeightsOpt = Annotated[
    str,
    typer.Option(
        help="auto (the default: q4 where it computes the float model's bits, else float), float "
        "(the model's weights in the compute dtype), q4 (the GGUF's own 4-bit Q4_1 groups read "
        "in place by the own kernels: a quarter of the bytes a decode step reads; own runner, CPU) "
        "or q4a8 (q4 with decode rows in 8 bits a group, as llama.cpp computes Q4_1: faster "
        "single streams, another model numerically with its own cache namespace)."
    ),
]
RunnerOpt = Annotated[
    str,
    typer.Option(
        help="auto (the own batched runner for Llama-family models), llama, or hf (the 0.1 runner)."
    ),
]
ThreadsOpt = Annotated[int | None, typer.Option(help="CPU threads (default: all cores).")]


def _fail(exc: Exception) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def generate(
    prompt: Annotated[
        str | None, typer.Argument(help="A raw prompt (no chat template). Or use --user.")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System message (chat mode).")] = None,
    user: Annotated[str | None, typer.Option(help="User message (chat mode).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    model: ModelOpt = None,
    runner: RunnerOpt = "auto",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = "auto",
    threads: ThreadsOpt = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Run with the prefix cache off.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object: text, usage, ttft_s.")
    ] = False,
) -> None:
    """Generate a completion and print it with its usage (prompt, cached, written tokens, TTFT)."""
    from rich.console import Console
    from rich.table import Table

    from prefixcache.engine.engine import Engine

    if prompt is None and user is None:
        raise typer.BadParameter("pass a prompt, or --user (and optionally --system)", param_hint="PROMPT")
    try:
        engine = Engine(
            model, runner=runner, dtype=dtype, threads=threads, enable_cache=not no_cache, weights=weights
        )
        if prompt is not None and user is None:
            r = engine.generate(
                prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
        else:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user or prompt}
            ]
            r = engine.generate(
                messages=msgs, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
    except ValueError as exc:
        _fail(exc)
        return
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "text": r.text,
                    "usage": r.usage.as_dict(),
                    "ttft_s": r.ttft_s,
                    "finish_reason": r.finish_reason,
                }
            )
        )
        return
    console = Console()
    console.print(r.text)
    t = Table(title="usage")
    for col in ("prompt", "cached", "written", "completion", "TTFT (s)", "finish"):
        t.add_column(col, justify="right")
    u = r.usage
    t.add_row(
        str(u.prompt_tokens),
        str(u.cached_tokens),
        str(u.cache_write_tokens),
        str(u.completion_tokens),
        f"{r.ttft_s:.3f}",
        r.finish_reason,
    )
    console.print(t)


def demo(
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per request (kept short).")] = 4,
    model: ModelOpt = None,
    runner: RunnerOpt = "auto",
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Run the prompt-caching flows on the real model and print one table, a row per flow:
    warm, cold after a deploy, cache busting (top vs bottom), TTL vs traffic, keep-warm."""
    from rich.console import Console
    from rich.table import Table

    from prefixcache.engine.demo import run_demo
    from prefixcache.engine.engine import select_runner
    from prefixcache.engine.llama import LlamaRunner
    from prefixcache.engine.model import ModelRunner, env_dtype
    from prefixcache.engine.runtime import off_this_thread

    console = Console(width=None if sys.stdout.isatty() else 120)
    steps = _Steps(Console(stderr=True, soft_wrap=True))
    with console.status("loading the model") as status:
        steps("loading the model (the first run converts it once, about a minute)", status)
        try:
            env_dtype()  # a bad $PREFIXCACHE_DTYPE fails before the model loads
            base = ModelRunner.load(model, threads=threads)
            chosen = off_this_thread(lambda: select_runner(base, runner, dtype))
        except ValueError as exc:
            _fail(exc)
            return
        rows, cold = run_demo(chosen, max_tokens=max_tokens, progress=lambda m: steps(f"flow {m}", status))
        steps.done()
    kind = "own runner, any 16-token block" if isinstance(chosen, LlamaRunner) else "HF runner, chunk 512"
    t = Table(title=f"prefix caching flows ({chosen.name}, {chosen.dtype_name}, {kind})")
    for col, just in (
        ("flow", "left"),
        ("requests", "right"),
        ("hit rate", "right"),
        ("cached tokens", "right"),
        ("TTFT (s)", "right"),
        ("speedup", "right"),
        ("what it shows", "left"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        t.add_row(
            r.flow,
            str(r.requests),
            f"{r.hit_rate:.0%}",
            f"{r.cached_tokens:,}",
            f"{r.ttft_s:.3f}",
            f"{r.speedup(cold):.1f}x",
            r.note,
        )
    console.print(t)
    console.print("TTFT: median after each flow's first request; speedup: the flow's cold TTFT over that.")


class _Steps:
    """Progress of a long command, one line per step on stderr with the time the last one took
    (also in a pipe or a log, where a spinner shows nothing), besides the spinner's text."""

    def __init__(self, console: Any) -> None:
        import time

        self.console = console
        self.clock = time.monotonic
        self.started = self.clock()
        self.last: tuple[str, float] | None = None

    def __call__(self, message: str, status: Any) -> None:
        self.done()
        status.update(message)
        self.last = (message, self.clock())

    def done(self) -> None:
        if self.last is not None:
            message, at = self.last
            total = self.clock() - self.started
            self.console.print(f"[dim]{message}: {self.clock() - at:.1f} s (total {total:.0f} s)[/dim]")
            self.last = None


def bench(
    lengths: Annotated[str, typer.Option(help="Comma-separated prefix lengths.")] = "256,512,1024,1536,2048",
    tail: Annotated[int, typer.Option(min=1, help="Uncached tail tokens after the prefix.")] = 64,
    repeats: Annotated[int, typer.Option(min=1, help="Repeats per figure (medians).")] = 3,
    prefill_chunk: Annotated[
        int | None, typer.Option(min=1, help="Prefill chunk (default: the engine's).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Where engine.md, engine_ttft.png, calibration.json go.")] = Path(
        "benchmarks/results"
    ),
    model: ModelOpt = None,
    runners: Annotated[
        str, typer.Option(help="Comma-separated runners to measure in this run: llama, hf.")
    ] = "llama,hf",
    dtype: DtypeOpt = None,
    weights: WeightsOpt = "auto",
    threads: ThreadsOpt = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="How to print the report: markdown (as written to engine.md, one line per row), "
            "table (fits the terminal), csv, or json (the results file's content).",
        ),
    ] = "markdown",
    llamacpp_python: Annotated[
        Path | None,
        typer.Option(
            help="A Python interpreter with llama-cpp-python (e.g. /work/peers/llama/bin/python): adds "
            "a llama.cpp column on the same GGUF and thread count (a skip line when it is missing)."
        ),
    ] = None,
) -> None:
    """Measure cold/warm/floor TTFT over prefix lengths, the 0%-hit overhead, exact vs
    single-pass prefill, decode and hashing+lookup time, for each runner in one run; print a
    table and write benchmarks/results/."""

    from prefixcache.analysis.report.tables import FORMATS, emit_markdown, report_console
    from prefixcache.engine.bench import DECODE_TOKENS, markdown, run_bench, write_results
    from prefixcache.engine.bench_peer import LlamaCppPeer, peer_lines
    from prefixcache.engine.engine import quantized_runner, select_runner
    from prefixcache.engine.model import ModelRunner, env_dtype
    from prefixcache.engine.runtime import off_this_thread

    if fmt not in FORMATS:
        raise typer.BadParameter(f"{fmt!r}: choose one of {', '.join(FORMATS)}", param_hint="--format")
    console = report_console()
    try:
        sizes = [int(x) for x in lengths.split(",") if x.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError(lengths)
    except ValueError as exc:
        raise typer.BadParameter(
            "lengths must be integers, e.g. 256,512,1024", param_hint="--lengths"
        ) from exc
    kinds = [k.strip() for k in runners.split(",") if k.strip()]
    if not kinds or any(k not in ("llama", "hf") for k in kinds):
        raise typer.BadParameter(
            "runners must be a comma-separated list of llama and hf", param_hint="--runners"
        )
    with console.status("loading the model") as status:
        try:
            env_dtype()  # a bad $PREFIXCACHE_DTYPE fails before the model loads
            base = ModelRunner.load(model, threads=threads)

            def chosen(kind: str) -> ModelRunner:  # built off this thread: no OpenMP pool stays here
                if kind == "hf":
                    return off_this_thread(lambda: select_runner(base, kind, None))
                return off_this_thread(
                    lambda: quantized_runner(base, select_runner(base, kind, dtype), weights)
                )

            peer = None
            if llamacpp_python is not None:  # up for the whole run, measured in turn with the first runner
                status.update("llama.cpp: loading the same GGUF")
                peer = LlamaCppPeer(
                    llamacpp_python,
                    getattr(base, "source_path", None) or Path(),
                    threads=base.threads,
                    n_ctx=max(max(sizes) + tail, 32 + DECODE_TOKENS + 1) + 64,
                )
            try:
                res = [
                    run_bench(
                        chosen(kind),
                        kind=kind,
                        lengths=sizes,
                        tail=tail,
                        repeats=repeats,
                        prefill_chunk=prefill_chunk,
                        progress=lambda m: status.update(m),
                        peer=peer if i == 0 else None,
                    )
                    for i, kind in enumerate(kinds)
                ]
            finally:
                if peer is not None:
                    peer.close()
        except ValueError as exc:
            _fail(exc)
            return
    command = "prefixcache " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    files = write_results(res, out, command)
    text = markdown(res, command)
    if peer is not None:
        own = res[0]
        figures = peer.result()
        q4 = getattr(res[0], "weights", "") in ("q4_1", "q4_1a8")  # 4-bit weights: the >= 1x target
        section = "\n".join(peer_lines(figures, own.decode_tps, own.single_pass_tps, q4))
        text += "\n" + section
        (out / "engine.md").write_text(text)
        (out / "llamacpp.json").write_text(json.dumps(figures.as_dict(), indent=2) + "\n")
        files.append(out / "llamacpp.json")
    files.append(_keep_calibration(out))
    if fmt == "json":
        print(next(f for f in files if f.suffix == ".json").read_text(), end="")
    else:
        emit_markdown(console, text, fmt)
    typer.echo("wrote " + ", ".join(str(f) for f in files), err=fmt in ("json", "csv"))


def _keep_calibration(out: Path) -> Path:
    """Copy the calibration just measured to where ``simulate`` finds it from any directory
    (``$PREFIXCACHE_HOME/calibration.json``, default ``~/.cache/prefixcache``)."""
    import os

    from prefixcache.analysis.costs import CALIBRATION_NAME, user_calibration

    target = user_calibration()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes((out / CALIBRATION_NAME).read_bytes())
    os.replace(tmp, target)
    return target


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the root app."""
    app.command("generate")(generate)
    app.command("demo")(demo)
    app.command("bench")(bench)
