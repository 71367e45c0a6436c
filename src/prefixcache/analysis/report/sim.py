"""The simulator's terminal report, its sweep table and the sweep's plot."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from prefixcache.analysis.report.checks import print_checks, ttft_text
from prefixcache.analysis.report.common import fig as _fig
from prefixcache.analysis.report.common import pct as _pct
from prefixcache.analysis.report.tables import ReportTable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from prefixcache.analysis.simulate import SimResult

__all__ = ["plot_sweep", "print_sim", "print_sweep"]


def print_sim(res: SimResult, console: Console, fmt: str = "table") -> None:
    c = res.config
    d = res.as_dict()
    console.print(
        f"[bold]Simulation[/bold] {d['requests']:,} requests, TTL {c.ttl_s:g} s, capacity "
        f"{c.capacity_bytes / 2**30:,.1f} GiB x {c.replicas} replica(s), routing {c.routing}, "
        f"block {c.block_size}" + (f", keep-warm {', '.join(c.keep_warm)}" if c.keep_warm else "")
    )
    t = ReportTable(show_header=False)
    t.add_row("hit rate", f"[bold]{_pct(res.hit_rate)}[/bold]")
    t.add_row(
        "prompt / cached / prefilled tokens",
        f"{d['prompt_tokens']:,} / {d['cached_tokens']:,} / {d['prefilled_tokens']:,}",
    )
    t.add_row("prefill time", f"{d['prefill_s']:,.0f} s at {c.cost.prefill_tps:g} tok/s ({c.cost.source})")
    t.add_row("cache bytes per token", f"{c.cost.kv_bytes_per_token:,} ({c.cost.kv_source})")
    t.add_row("estimated TTFT", ttft_text(res))
    if c.keep_warm:
        pins = f"{res.keep_warm_refreshes:,} ({d['keep_warm_read_tokens']:,} tokens read)"
        t.add_row("keep-warm pin requests", pins)
    t.emit(console, fmt)
    et = ReportTable(title="Per endpoint")
    for col in ("endpoint", "requests", "hit rate", "TTFT p50", "TTFT p95"):
        et.add_column(col, justify="left" if col == "endpoint" else "right")
    for e in res.endpoints:
        et.add_row(
            escape(e["endpoint"]),
            f"{e['requests']:,}",
            _pct(e["hit_rate"]),
            f"{e['ttft_s']['p50']:.2f} s" + ("" if e["ttft_s"]["meaningful"] else " (saturated)"),
            f"{e['ttft_s']['p95']:.2f} s" + ("" if e["ttft_s"]["meaningful"] else " (saturated)"),
        )
    et.emit(console, fmt)
    if c.replicas > 1:
        rt = ReportTable(title="Per replica")
        for col in ("replica", "requests", "hit rate", "blocks", "evictions (capacity/ttl)"):
            rt.add_column(col, justify="right")
        for r in res.replicas:
            ev = r["evictions"]
            rt.add_row(
                str(r["replica"]),
                f"{r['requests']:,}",
                _pct(r["hit_rate"]),
                f"{r['blocks']:,}",
                f"{ev.get('capacity', 0):,}/{ev.get('ttl', 0):,}",
            )
        rt.emit(console, fmt)
    ct = ReportTable(title="Cost")
    for col in (
        "pricing",
        "input",
        "cache writes",
        "cache reads",
        "output",
        "keep-warm",
        "total",
        "without cache",
        "saving",
    ):
        ct.add_column(col, justify="right")
    for x in res.costs:
        dollars = (
            x.input_usd,
            x.cache_write_usd,
            x.cache_read_usd,
            x.output_usd,
            x.keep_warm_usd,
            x.total_usd,
            x.no_cache_usd,
        )
        ct.add_row(x.profile, *(f"${v:,.2f}" for v in dollars), _pct(x.saving))
    ct.emit(console, fmt)
    print_checks(res, console, fmt)


def print_sweep(
    name: str, labels: list[str], results: list[SimResult], console: Console, fmt: str = "table"
) -> None:
    t = ReportTable(title=f"Sweep over {name}")
    for col in (
        "value",
        "hit rate",
        "prefilled tokens",
        "TTFT p50",
        "TTFT p95",
        *[f"{p} $" for p in results[0].config.pricing],
    ):
        t.add_column(col, justify="right")
    for label, r in zip(labels, results, strict=True):
        d = r.as_dict()
        mark = "" if d["ttft_s"]["meaningful"] else " [bold red](saturated)[/bold red]"
        t.add_row(
            label,
            _pct(r.hit_rate),
            f"{d['prefilled_tokens']:,}",
            f"{d['ttft_s']['p50']:.2f} s{mark}",
            f"{d['ttft_s']['p95']:.2f} s{mark}",
            *(f"{x.total_usd:,.2f}" for x in r.costs),
        )
    t.emit(console, fmt)
    saturated = [
        label for label, r in zip(labels, results, strict=True) if not r.as_dict()["ttft_s"]["meaningful"]
    ]
    if saturated:
        console.print(
            f"[bold red]saturated[/bold red] at {name}={', '.join(saturated)}: the offered prefill exceeds "
            "what the replicas compute, so those TTFTs are not meaningful (add replicas or give the "
            "hardware's --prefill-tps)."
        )


def plot_sweep(name: str, labels: list[str], values: list[float], results: list[SimResult]) -> Figure:
    fig = _fig(8, 4)
    ax = fig.add_subplot()
    ax.plot(values, [100 * r.hit_rate for r in results], marker="o", color="tab:blue", label="hit rate")
    ax.set_xscale("log")
    ax.set_xticks(values, labels)
    ax.set_xlabel({"ttl": "TTL (s)", "capacity": "capacity per replica (bytes)"}.get(name, name))
    ax.set_ylabel("hit rate (%)", color="tab:blue")
    ax.set_ylim(0, 100)
    if results[0].costs:
        ax2 = ax.twinx()
        for k, prof in enumerate(results[0].config.pricing):
            ax2.plot(
                values,
                [r.costs[k].total_usd for r in results],
                marker="s",
                linestyle="--",
                label=f"{prof} $",
                color=("tab:red", "tab:orange", "tab:green", "tab:purple")[k % 4],
            )
        ax2.set_ylabel("cost ($)")
        ax2.legend(loc="lower right", fontsize="small")
    saturated = [v for v, r in zip(values, results, strict=True) if not r.as_dict()["ttft_s"]["meaningful"]]
    if saturated:
        ax.plot(
            saturated,
            [100 * r.hit_rate for v, r in zip(values, results, strict=True) if v in saturated],
            linestyle="none",
            marker="X",
            markersize=11,
            color="tab:red",
            label="saturated: TTFT not meaningful",
        )
        ax.legend(loc="upper left", fontsize="small")
    title = f"Hit rate and cost against {name}"
    ax.set_title(title + (" (red X: replicas saturated)" if saturated else ""))
    return fig
