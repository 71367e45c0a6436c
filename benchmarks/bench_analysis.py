"""Throughput of the ops tools: trace synthesis, loading, audit and simulation at 10^5 and 10^6 requests.

    python benchmarks/bench_analysis.py                      # 10^5 and 10^6
    python benchmarks/bench_analysis.py --sizes 100000 --no-replay

Uses the default synthetic scenario (``prefixcache trace synth``: five endpoints, ~1,400-token
prompts, two of them busted by a timestamp / uuid). Writes a table to stdout and to
``benchmarks/results/analysis.md``. The audit is timed twice: the scan alone (busting spans,
divergence, versions, TTL gaps, keep-warm: everything but the achieved hit rate) and with the
replay through the real PrefixCache that supplies the achieved hit rate when the trace carries
no ``cached_tokens`` (that replay is the simulator's own loop).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prefixcache.analysis.audit import AuditConfig, audit
from prefixcache.analysis.simulate import SimConfig, simulate
from prefixcache.analysis.synth import DEFAULT_SCENARIO, parse_endpoint, synthesize
from prefixcache.analysis.trace import load_trace

RESULTS = Path(__file__).parent / "results" / "analysis.md"


class _Timer:
    """Wall and CPU seconds of a block (the machine is shared: CPU time is the steadier figure)."""

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def bench(n: int, folder: Path, replay: bool, console: Console) -> list[tuple[str, float, float, int, float]]:
    """Rows (stage, wall s, CPU s, requests, blocks per request) for one trace size."""
    path = folder / f"trace_{n}.jsonl"
    rows: list[tuple[str, float, float]] = []
    with _Timer() as tm:
        synthesize(path, [parse_endpoint(s) for s in DEFAULT_SCENARIO], requests=n, seed=1)
    rows.append(("synth", tm.wall, tm.cpu))
    with _Timer() as tm:
        trace = load_trace(path)
    rows.append(("load", tm.wall, tm.cpu))
    blocks = float(trace.prompt_tokens.mean()) / 16
    console.print(f"{n:,} requests, {path.stat().st_size / 1e6:,.0f} MB, {blocks:.0f} blocks/request")
    with _Timer() as tm:
        audit(trace, AuditConfig(replay=False))
    rows.append(("audit (scan)", tm.wall, tm.cpu))
    console.print(f"  audit scan: {tm.wall:.1f} s")
    with _Timer() as tm:
        res = simulate(trace, SimConfig(pricing=()))
    rows.append(("simulate, 1 replica", tm.wall, tm.cpu))
    console.print(f"  simulate: {tm.wall:.1f} s, hit rate {res.hit_rate:.3f}")
    if replay:
        rows.append(("audit (scan + replay)", rows[2][1] + rows[3][1], rows[2][2] + rows[3][2]))
    if n <= 100_000:
        with _Timer() as tm:
            simulate(trace, SimConfig(replicas=4, routing="cache-aware", pricing=()))
        rows.append(("simulate, 4 replicas cache-aware", tm.wall, tm.cpu))
    path.unlink()
    return [(name, w, c, n, blocks) for name, w, c in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--no-replay", action="store_true", help="skip the audit-with-replay row")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            rows.extend(bench(n, Path(tmp), not args.no_replay, console))
    table = Table(title="prefixcache ops tools throughput")
    for col in ("stage", "requests", "wall s", "CPU s", "requests/CPU s", "CPU us/block"):
        table.add_column(col, justify="right")
    md = ["| stage | requests | wall s | CPU s | requests per CPU s | CPU µs per block |", "|---|---:|---:|---:|---:|---:|"]
    for name, w, c, n, blocks in rows:
        cells = (f"{n:,}", f"{w:,.1f}", f"{c:,.1f}", f"{n / c:,.0f}", f"{1e6 * c / (n * blocks):.2f}")
        table.add_row(name, *cells)
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    console.print(table)
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Ops tools throughput\n\n"
        f"`python benchmarks/bench_analysis.py --sizes {' '.join(map(str, args.sizes))}` on {host}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"
        "Default synth scenario (five endpoints, ~97 blocks of 16 tokens per request, 35% of traffic busted).\n"
        "Wall time depends on what else runs on the shared machine; CPU time (this process) is steadier.\n\n"
        + "\n".join(md) + "\n"
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
