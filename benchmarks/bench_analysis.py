"""Throughput of the ops tools: trace synthesis, loading, audit and simulation at 10^5 and 10^6 requests.

    python benchmarks/bench_analysis.py                      # 10^5 and 10^6
    python benchmarks/bench_analysis.py --sizes 100000 --no-cli

Uses the default synthetic scenario (``prefixcache trace synth``: five endpoints, ~1,550-token
prompts, two of them busted by a timestamp / uuid). Stages of a loaded trace are timed in this
process (wall and CPU seconds; the audit with ``always_replay`` runs a PrefixCache replay in a
forked child beside its scan, so its row is wall time). Then the streamed forms (a reader
process parses the file and computes keys while the consumers work: ``audit_file``,
``simulate_file``), with the CPU seconds of every process. Last, the two commands a user runs are
timed end to end, as subprocesses: ``prefixcache
audit TRACE --json`` and ``prefixcache simulate TRACE --json`` (``--repeat`` times each: the
median, with the range). Writes a table to stdout, ``benchmarks/results/analysis.md`` and a bar
chart ``benchmarks/results/analysis.png``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prefixcache.analysis.audit import AuditConfig, audit, audit_file
from prefixcache.analysis.simulate import SimConfig, simulate, simulate_file
from prefixcache.analysis.trace import load_trace
from prefixcache.analysis.trace.synth import DEFAULT_SCENARIO, parse_endpoint, synthesize

RESULTS = Path(__file__).parent / "results" / "analysis.md"
TARGET_S = 60.0  # issue 4: audit and simulate 10^6 requests in under 60 s


class _Timer:
    """Wall and CPU seconds of a block (the machine is shared: CPU time is the steadier figure);
    ``children=True`` adds the CPU of child processes that ended inside the block."""

    def __init__(self, children: bool = False) -> None:
        self.children = children

    def _cpu(self) -> float:
        t = os.times()
        return t.user + t.system + (t.children_user + t.children_system if self.children else 0.0)

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), self._cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = self._cpu() - self.cpu


def _cli(args: list[str]) -> float:
    """Wall seconds of one ``prefixcache`` command (output discarded)."""
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "prefixcache", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def bench(
    n: int, folder: Path, cli: bool, repeat: int, console: Console
) -> list[tuple[str, float, float | None, int]]:
    """Rows (stage, wall s, CPU s or None, requests) for one trace size."""
    path = folder / f"trace_{n}.jsonl"
    rows: list[tuple[str, float, float | None]] = []
    with _Timer() as tm:
        synthesize(path, [parse_endpoint(s) for s in DEFAULT_SCENARIO], requests=n, seed=1)
    rows.append(("synth", tm.wall, tm.cpu))
    with _Timer() as tm:
        trace = load_trace(path)
    rows.append(("load", tm.wall, tm.cpu))
    blocks = float(trace.prompt_tokens.mean()) / 16
    console.print(f"{n:,} requests, {path.stat().st_size / 1e6:,.0f} MB, {blocks:.0f} blocks/request")
    with _Timer() as tm:
        audit(trace, AuditConfig())
    rows.append(("audit (the scan)", tm.wall, tm.cpu))
    console.print(f"  audit: {tm.wall:.1f} s")
    with _Timer() as tm:
        audit(trace, AuditConfig(always_replay=True))
    rows.append(("audit + PrefixCache replay (forked, wall)", tm.wall, None))
    with _Timer() as tm:
        res = simulate(trace, SimConfig(pricing=()))
    rows.append(("simulate, 1 replica", tm.wall, tm.cpu))
    console.print(f"  simulate: {tm.wall:.1f} s, hit rate {res.hit_rate:.3f}")
    if n <= 100_000:
        with _Timer() as tm:
            simulate(trace, SimConfig(replicas=4, routing="cache-aware", pricing=()))
        rows.append(("simulate, 4 replicas cache-aware", tm.wall, tm.cpu))
    del trace
    with _Timer(children=True) as tm:
        audit_file(path, AuditConfig())
    rows.append(("audit streamed (audit_file: reader + scan)", tm.wall, tm.cpu))
    with _Timer(children=True) as tm:
        simulate_file(path, SimConfig(pricing=()))
    rows.append(("simulate streamed (simulate_file: reader + replay)", tm.wall, tm.cpu))
    console.print(f"  streamed: audit {rows[-2][1]:.1f} s, simulate {rows[-1][1]:.1f} s")
    if cli:
        for cmd in ("audit", "simulate"):
            runs = sorted(_cli([cmd, str(path), "--json"]) for _ in range(repeat))
            spread = f" (median of {repeat}: {runs[0]:.1f} to {runs[-1]:.1f})" if repeat > 1 else ""
            rows.append((f"`prefixcache {cmd} TRACE --json`, end to end{spread}", runs[len(runs) // 2], None))
            console.print(f"  CLI {cmd}: {', '.join(f'{r:.1f}' for r in runs)} s")
    path.unlink()
    return [(name, w, c, n) for name, w, c in rows]


def plot(rows: list[tuple[str, float, float | None, int]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r[3] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    for ax, n in zip(axes[0], sizes, strict=True):
        mine = [r for r in rows if r[3] == n and r[0] != "synth"]
        names = [r[0].replace("`", "").replace(" TRACE --json", "").split(" (")[0] for r in mine]
        ax.barh(names[::-1], [r[1] for r in mine][::-1], color="#4477aa")
        if n >= 1_000_000:
            ax.axvline(TARGET_S, color="#cc3311", linestyle="--", label=f"target {TARGET_S:.0f} s")
            ax.legend(loc="upper right")
        ax.set_xlabel("wall seconds")
        ax.set_title(f"{n:,} requests")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--no-cli", action="store_true", help="skip the end-to-end command rows")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each end-to-end command (the median is shown)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            rows.extend(bench(n, Path(tmp), not args.no_cli, args.repeat, console))
    table = Table(title="prefixcache ops tools throughput")
    for col in ("stage", "requests", "wall s", "CPU s", "µs per request (wall)"):
        table.add_column(col, justify="right")
    md = ["| stage | requests | wall s | CPU s | µs per request (wall) |", "|---|---:|---:|---:|---:|"]
    for name, w, c, n in rows:
        cells = (f"{n:,}", f"{w:,.1f}", "" if c is None else f"{c:,.1f}", f"{1e6 * w / n:,.0f}")
        table.add_row(name, *cells)
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    console.print(table)
    cpu = platform.processor() or platform.machine()
    host = f"{cpu}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(rows, png)
    args.out.write_text(
        "# Ops tools throughput\n\n"
        f"`python benchmarks/bench_analysis.py --sizes {' '.join(map(str, args.sizes))}` on {host}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"
        "Default synth scenario (five endpoints, ~97 blocks of 16 tokens per request, "
        "35% of traffic busted).\n"
        "Wall time depends on what else runs on the shared machine; CPU time is steadier (this process; "
        "for the streamed rows, every process).\n\n" + "\n".join(md) + f"\n\n![stage times]({png.name})\n"
    )
    console.print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
