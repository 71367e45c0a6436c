"""The simulator's table of what makes its answer meaningless or costly: replica load against
``--prefill-tps`` and, per pricing profile, each endpoint's reuse against the write surcharge's
break-even (see :mod:`~prefixcache.analysis.sim_checks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from prefixcache.analysis.report.tables import ReportTable

if TYPE_CHECKING:
    from prefixcache.analysis.simulate import SimResult


def ttft_text(res: SimResult) -> str:
    """The TTFT row: the figures, or the figures marked not meaningful under saturation."""
    tt = res.as_dict()["ttft_s"]
    text = f"mean {tt['mean']:.2f} s, p50 {tt['p50']:.2f} s, p95 {tt['p95']:.2f} s"
    if not tt["meaningful"]:
        return f"[bold red]SATURATED, not meaningful[/bold red] ({text})"
    return text


def print_checks(res: SimResult, console: Console, fmt: str = "table") -> None:
    """The load table (and its warning) and the break-even table, where they say something."""
    load = res.load
    lt = ReportTable(title=f"Replica load (prefill at {res.config.cost.prefill_tps:g} tok/s)")
    for col in ("replica", "offered prefill", "utilisation", ""):
        lt.add_column(col, justify="right")
    for r in res.replicas:
        u = r["utilisation"]
        lt.add_row(
            str(r["replica"]),
            f"{r['offered_prefill_s']:,.0f} s",
            "n/a (one timestamp)" if u is None else f"{u:.1%}",
            "[bold red]SATURATED[/bold red]" if r["saturated"] else "",
        )
    lt.emit(console, fmt)
    if load.get("warning"):
        console.print(f"[bold red]warning:[/bold red] {load['warning']}")
    for even in res.break_even:
        if not even["break_even_reuse"] and not even["break_even_reuse_1h"]:
            continue  # no write surcharge: caching never costs more
        bt = ReportTable(
            title=(
                f"Break-even ({even['profile']}: writes {even['write_mult']:g}x, "
                f"reads {even['read_mult']:g}x "
                f"-> p* = {even['break_even_reuse']:.3f}; 1 h writes {even['write_long_mult']:g}x -> "
                f"{even['break_even_reuse_1h']:.3f})"
            ),
        )
        for col in ("endpoint", "reuse p", "p*", "caching adds", "verdict"):
            bt.add_column(col, justify="left" if col in ("endpoint", "verdict") else "right")
        for e in even["endpoints"]:
            reuse = e["reuse_probability"]
            bt.add_row(
                escape(e["endpoint"]),
                "n/a" if reuse is None else f"{reuse:.3f}",
                f"{e['break_even_reuse']:.3f}",
                f"{'-' if e['extra_input_usd'] < 0 else '+'}${abs(e['extra_input_usd']):,.2f}",
                "[bold red]caching loses money[/bold red]" if e["loses_money"] else "pays",
            )
        bt.emit(console, fmt)
