"""The audit's terminal report (tables, advice and fix lines) and its plots (PNG files; the HTML
page is :mod:`prefixcache.analysis.report.html`). matplotlib runs on the Agg backend and is
imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.markup import escape

from prefixcache.analysis.report.common import fig as _fig
from prefixcache.analysis.report.common import pct as _pct
from prefixcache.analysis.report.common import png as _png
from prefixcache.analysis.report.tables import ReportTable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from prefixcache.analysis.audit import AuditResult


# ------------------------------------------------------------------------------------ audit
def print_audit(res: AuditResult, console: Console, fmt: str = "table") -> None:
    """The audit as tables: overview, busting spans, stability and TTL, keep-warm."""
    console.print(
        f"[bold]Audit[/bold] {len(res.ts):,} requests, TTL {res.config.ttl_s:g} s, "
        f"block {res.config.block_size}: "
        f"hit rate [bold]{_pct(res.hit_rate)}[/bold] of an achievable {_pct(res.achievable_hit_rate)} "
        f"[dim](achieved from {res.achieved_source})[/dim]"
    )
    for missing in res.unavailable:
        console.print(f"[yellow]not available from this trace:[/yellow] {missing}")
    endpoints, busting = audit_tables(res)
    endpoints.emit(console, fmt)
    if busting is not None:
        busting.emit(console, fmt)
        for name, line in fix_lines(res):
            console.print(f"[yellow]Fix[/yellow] ([bold]{escape(name)}[/bold]): {escape(line)}")
    else:
        console.print("[green]No cache-busting spans found.[/green]")
    for name, line in advice_lines(res):
        console.print(f"[bold]{escape(name)}[/bold]: {escape(line)}")


def audit_tables(res: AuditResult) -> tuple[ReportTable, ReportTable | None]:
    """The audit's tables (endpoints; busting spans, None when there are none): the terminal
    and the HTML report print the same."""
    t = ReportTable(title="Endpoints")
    for col in (
        "endpoint",
        "requests",
        "hit rate",
        "achievable",
        "diverge p50",
        "stable prefix",
        "versions",
        "dominant",
        "reuse gap p50",
        "lost to TTL",
        "keep warm",
    ):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for e in res.endpoints:
        gp = e["reuse_gap_s"]["p50"]
        t.add_row(
            escape(e["endpoint"]),
            f"{e['requests']:,}",
            _pct(e["hit_rate"]),
            _pct(e["achievable_hit_rate"]),
            "-" if e["divergence"]["p50"] is None else f"{e['divergence']['p50']:.0f}",
            f"{e['stable_prefix_tokens']:,}",
            str(e["prefix_versions"]),
            _pct(e["dominant_prefix_share"]),
            "-" if gp is None else f"{gp:.1f} s",
            f"{e['ttl_expired_requests']:,}",
            "[green]yes[/green]" if e["keep_warm"] else "no",
        )
    spans = [(e["endpoint"], b) for e in res.endpoints for b in e["busting"]]
    bt = None
    if spans:
        bt = ReportTable(title="Cache-busting spans (variable content above shared content)")
        for col in (
            "endpoint",
            "token",
            "length",
            "kind",
            "example",
            "tokens lost/request",
            "saving if moved alone",
            "saving if all moved",
        ):
            right = col in ("token", "length", "tokens lost/request") or "saving" in col
            bt.add_column(col, justify="right" if right else "left")
        for name, b in spans:
            bt.add_row(
                escape(name),
                str(b["start_token"]),
                str(b["length_tokens"]),
                f"[bold red]{b['kind']}[/bold red]",
                escape((b["examples"] or [""])[0][:40]),
                f"{b['tokens_lost_per_request']:,.0f}",
                _saving(b, "moved_below"),
                _saving(b, "all_moved_below"),
            )
    return t, bt


def advice_lines(res: AuditResult) -> list[tuple[str, str]]:
    """(endpoint, advice) on prefix stability and keep-warm: the terminal and the HTML report say
    the same."""
    out = []
    for e in res.endpoints:
        if e["prefix_versions"] > 5:
            span = e["versions"][-1]["first_ts"] - e["versions"][0]["first_ts"]
            out.append(
                (
                    e["endpoint"],
                    f"{e['prefix_versions']} prefix versions, one every "
                    f"~{span / (e['prefix_versions'] - 1):,.0f} s: the stable prefix keeps changing.",
                )
            )
        elif e["prefix_versions"] > 1:
            vs = ", ".join(f"{v['requests']:,} req from ts {v['first_ts']:.0f}" for v in e["versions"])
            out.append(
                (
                    e["endpoint"],
                    f"{e['prefix_versions']} prefix versions ({vs}); "
                    f"each change re-prefills {e['stable_prefix_tokens']:,} tokens per replica.",
                )
            )
        if e["keep_warm"]:
            out.append(
                (
                    e["endpoint"],
                    f"keep warm: {e['keep_warm_refreshes']:,} refreshes of "
                    f"{e['keep_warm_prefix_tokens']:,} tokens cost {e['keep_warm_cost_tokens']:,.0f} "
                    f"token-equivalents, save {e['keep_warm_saved_tokens']:,.0f} "
                    f"({e['ttl_expired_requests']:,} requests lost to the TTL).",
                )
            )
    return out


def _saving(row: dict[str, Any], what: str) -> str:
    return f"{row[f'saving_tokens_if_{what}']:,.0f} tok (${row[f'saving_usd_if_{what}']:,.2f})"


def busting_stacks(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """An endpoint's busting rows grouped into stacks: values found in the same prompts (each
    row's ``stacked_with``), top first."""
    index = {(r["kind"], r["start_token"]): i for i, r in enumerate(rows)}
    parent = list(range(len(rows)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, r in enumerate(rows):
        for s in r.get("stacked_with", []):
            j = index.get((s["kind"], s["start_token"]))
            if j is not None:
                parent[find(j)] = find(i)
    groups: dict[int, list[dict[str, Any]]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(find(i), []).append(r)
    return sorted(groups.values(), key=lambda g: g[0]["start_token"])


def fix_lines(res: AuditResult) -> list[tuple[str, str]]:
    """(endpoint, what to do and what it saves) per stack of busting values: the terminal and the
    HTML report say the same."""
    out = []
    for e in res.endpoints:
        for stack in busting_stacks(e["busting"]):
            names = ", ".join(f"{b['kind']} at token {b['start_token']}" for b in stack)
            together = max(b["saving_tokens_if_all_moved_below"] for b in stack)
            usd = max(b.get("saving_usd_if_all_moved_below", 0.0) for b in stack)
            if len(stack) == 1:
                line = (
                    f"move the {names} below the stable content (end of the prompt): saves "
                    f"{together:,.0f} tokens (${usd:,.2f})."
                )
            else:
                alone = max(b["saving_tokens_if_moved_below"] for b in stack)
                line = (
                    f"move all {len(stack)} variable values ({names}) below the stable content (end of "
                    f"the prompt): together they save {together:,.0f} tokens (${usd:,.2f}); moving one "
                    f"alone saves at most {alone:,.0f}, since the others still vary above it."
                )
            out.append((e["endpoint"], line))
    return out


def plot_hit_rate_over_time(res: AuditResult, bins: int = 60) -> Figure:
    fig = _fig()
    ax = fig.add_subplot()
    t0, t1 = float(res.ts[0]), float(res.ts[-1])
    edges = np.linspace(t0, t1 + 1e-9, bins + 1)
    centers = (edges[:-1] + edges[1:]) / 2 - t0
    scale, unit = (3600.0, "h") if t1 - t0 > 7200 else (60.0, "min")
    for e, name in enumerate(res.endpoint_names):
        m = res.endpoint == e
        b = np.digitize(res.ts[m], edges) - 1
        q = np.bincount(b, weights=res.prompt_tokens[m], minlength=bins)[:bins]
        h = np.bincount(b, weights=res.achieved[m], minlength=bins)[:bins]
        ok = q > 0
        ax.plot(centers[ok] / scale, 100 * h[ok] / q[ok], marker=".", label=name)
    ax.set_xlabel(f"time since start ({unit})")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_ylim(-2, 102)
    ax.set_title("Hit rate over time per endpoint")
    ax.legend(fontsize="small", ncols=2)
    return fig


def plot_gaps(res: AuditResult) -> Figure:
    fig = _fig()
    ax = fig.add_subplot()
    g = res.gap_s
    ok = np.isfinite(g) & (g > 0)
    if ok.any():
        edges = np.logspace(np.log10(max(g[ok].min(), 1e-3)), np.log10(g[ok].max() * 1.01 + 1e-3), 40)
        for e, name in enumerate(res.endpoint_names):
            m = ok & (res.endpoint == e)
            if m.any():
                ax.hist(g[m], bins=edges, histtype="step", linewidth=1.5, label=name)
        ax.set_xscale("log")
    ax.axvline(res.config.ttl_s, color="red", linestyle="--", label=f"TTL {res.config.ttl_s:g} s")
    ax.set_xlabel("seconds since the prefix was last used")
    ax.set_ylabel("requests")
    ax.set_title("Reuse gaps against the TTL (right of the line: expired)")
    ax.legend(fontsize="small", ncols=2)
    return fig


def plot_divergence(res: AuditResult) -> Figure:
    fig = _fig()
    ax = fig.add_subplot()
    d = res.diverge
    ok = d >= 0
    if ok.any():
        edges = np.linspace(0, d[ok].max() + 1, 50)
        for e, name in enumerate(res.endpoint_names):
            m = ok & (res.endpoint == e)
            if m.any():
                ax.hist(d[m], bins=edges, histtype="step", linewidth=1.5, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("first token that differs from the most similar earlier request")
    ax.set_ylabel("requests")
    ax.set_title("Divergence points (early = little shared)")
    ax.legend(fontsize="small", ncols=2)
    return fig


AUDIT_PLOTS = {
    "hit_rate_over_time": plot_hit_rate_over_time,
    "reuse_gaps": plot_gaps,
    "divergence": plot_divergence,
}


def save_audit_plots(res: AuditResult, folder: str | Path, prefix: str = "audit_") -> list[Path]:
    out = []
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, fn in AUDIT_PLOTS.items():
        p = Path(folder) / f"{prefix}{name}.png"
        p.write_bytes(_png(fn(res)))
        out.append(p)
    return out
