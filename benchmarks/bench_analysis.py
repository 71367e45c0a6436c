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


def bench(n: int, folder: Path, replay: bool, console: Console) -> list[tuple[str, float, int, float]]:
    """Rows (stage, seconds, requests, blocks per request) for one trace size."""
    path = folder / f"trace_{n}.jsonl"
    rows = []
    t = time.perf_counter()
    synthesize(path, [parse_endpoint(s) for s in DEFAULT_SCENARIO], requests=n, seed=1)
    rows.append(("synth", time.perf_counter() - t))
    t = time.perf_counter()
    trace = load_trace(path)
    rows.append(("load", time.perf_counter() - t))
    blocks = float(trace.prompt_tokens.mean()) / 16
    console.print(f"{n:,} requests, {path.stat().st_size / 1e6:,.0f} MB, {blocks:.0f} blocks/request")
    t = time.perf_counter()
    audit(trace, AuditConfig(replay=False))
    rows.append(("audit (scan)", time.perf_counter() - t))
    t = time.perf_counter()
    res = simulate(trace, SimConfig(pricing=()))
    rows.append(("simulate, 1 replica", time.perf_counter() - t))
    console.print(f"  simulate: hit rate {res.hit_rate:.3f}")
    if replay:
        rows.append(("audit (scan + replay)", rows[2][1] + rows[3][1]))
    if n <= 100_000:
        t = time.perf_counter()
        simulate(trace, SimConfig(replicas=4, routing="cache-aware", pricing=()))
        rows.append(("simulate, 4 replicas cache-aware", time.perf_counter() - t))
    path.unlink()
    return [(name, s, n, blocks) for name, s in rows]


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
    for col in ("stage", "requests", "seconds", "requests/s", "us/block"):
        table.add_column(col, justify="right")
    md = ["| stage | requests | seconds | requests/s | µs per block |", "|---|---:|---:|---:|---:|"]
    for name, s, n, blocks in rows:
        table.add_row(name, f"{n:,}", f"{s:,.1f}", f"{n / s:,.0f}", f"{1e6 * s / (n * blocks):.2f}")
        md.append(f"| {name} | {n:,} | {s:,.1f} | {n / s:,.0f} | {1e6 * s / (n * blocks):.2f} |")
    console.print(table)
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Ops tools throughput\n\n"
        f"`python benchmarks/bench_analysis.py --sizes {' '.join(map(str, args.sizes))}` on {host}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"
        "Default synth scenario (five endpoints, ~90 blocks of 16 tokens per request, 35% of traffic busted).\n\n"
        + "\n".join(md) + "\n"
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
