"""The audit's HTML report (``prefixcache audit TRACE --html FILE``): one self-contained page with
what the terminal report says (the summary, the endpoint and busting tables with their savings
in tokens and dollars, every fix line, the prefix-stability and keep-warm advice) and the plots
(embedded PNGs), the raw JSON in a collapsed section at the end. No script, no external file."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.analysis.report.audit import AUDIT_PLOTS, advice_lines, audit_tables, fix_lines
from prefixcache.analysis.report.common import pct as _pct
from prefixcache.analysis.report.common import png as _png
from prefixcache.analysis.report.tables import ReportTable, plain

if TYPE_CHECKING:
    from prefixcache.analysis.audit import AuditResult

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;
  background:#fff;color:#222}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.big{font-size:1.3em} .dim{color:#666}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right;vertical-align:top}
th{background:#eef3fb} td.l,th.l{text-align:left} code{background:#f4f4f4;padding:0 3px}
.fix{background:#fff8e1;border-left:4px solid #f0a800;padding:.5em .8em;margin:.5em 0}
.advice{background:#eef7ee;border-left:4px solid #3a9a3a;padding:.5em .8em;margin:.5em 0}
.none{color:#2a7a2a} img{max-width:100%;border:1px solid #ddd;margin:.4em 0}
details{margin-top:2em} summary{cursor:pointer;font-weight:bold}
pre{overflow-x:auto;background:#f8f8f8;padding:1em}
"""


_NO_WARM = "No endpoint would save more than refreshing its prefix costs."


def table_html(t: ReportTable) -> str:
    """A report table as an HTML table (markup stripped, every cell escaped)."""
    head = "".join(f'<th class="{"l" if j != "right" else ""}">{html.escape(h)}</th>' for h, j in t.columns)
    rows = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"l" if j != "right" else ""}">{html.escape(plain(c))}</td>'
            for c, (_, j) in zip(row, t.columns, strict=True)
        )
        + "</tr>"
        for row in t.rows
    )
    return f"<table><tr>{head}</tr>{rows}</table>"


def _keep_warm(res: AuditResult) -> ReportTable | None:
    rows = [e for e in res.endpoints if e["keep_warm"]]
    if not rows:
        return None
    t = ReportTable(title="Keep-warm candidates")
    for col in ("endpoint", "prefix tokens", "refreshes", "refresh cost", "saved", "requests lost to TTL"):
        t.add_column(col, justify="left" if col == "endpoint" else "right")
    for e in rows:
        t.add_row(
            e["endpoint"],
            f"{e['keep_warm_prefix_tokens']:,}",
            f"{e['keep_warm_refreshes']:,}",
            f"{e['keep_warm_cost_tokens']:,.0f} token-equivalents",
            f"{e['keep_warm_saved_tokens']:,.0f} token-equivalents",
            f"{e['ttl_expired_requests']:,}",
        )
    return t


def audit_html(res: AuditResult, path: str | Path) -> Path:
    """Write the report to ``path`` and return it."""
    d = res.as_dict()
    endpoints, busting = audit_tables(res)
    fixes = "".join(
        f'<div class="fix"><b>Fix</b> ({html.escape(name)}): {html.escape(line)}</div>'
        for name, line in fix_lines(res)
    )
    advice = "".join(
        f'<div class="advice"><b>{html.escape(name)}</b>: {html.escape(line)}</div>'
        for name, line in advice_lines(res)
    )
    warm = _keep_warm(res)
    missing = "".join(
        f"<p class='dim'>Not available from this trace: {html.escape(m)}</p>" for m in res.unavailable
    )
    imgs = "".join(
        f'<h3>{html.escape(name.replace("_", " "))}</h3><img alt="{html.escape(name)}" '
        f'src="data:image/png;base64,{base64.b64encode(_png(fn(res))).decode()}">'
        for name, fn in AUDIT_PLOTS.items()
    )
    cfg = res.config
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>prefixcache audit</title>
<style>{_STYLE}</style></head><body>
<h1>prefixcache audit</h1>
<p class="big">{len(res.ts):,} requests &middot; TTL {cfg.ttl_s:g} s &middot; block {cfg.block_size} &middot;
pricing {html.escape(str(cfg.pricing))} &middot; hit rate <b>{_pct(res.hit_rate)}</b> of an achievable
<b>{_pct(res.achievable_hit_rate)}</b></p>
<p class="dim">Achieved from: {html.escape(res.achieved_source)}</p>
{missing}
<h2>What to fix</h2>
{fixes or '<p class="none">No cache-busting spans found.</p>'}
{advice}
<h2>Endpoints</h2>
{table_html(endpoints)}
<h2>Cache-busting spans</h2>
<p class="dim">Variable content above shared content. <i>Saving if moved alone</i>: moving that value
below the stable content while the others stay; <i>saving if all moved</i>: moving every value of its
stack.</p>
{table_html(busting) if busting is not None else '<p class="none">none found</p>'}
<h2>Keep-warm</h2>
{table_html(warm) if warm is not None else f'<p class="dim">{_NO_WARM}</p>'}
<h2>Plots</h2>
{imgs}
<details><summary>Raw JSON (the output of <code>prefixcache audit --json</code>)</summary>
<pre>{html.escape(json.dumps(d, indent=1, default=str))}</pre></details>
</body></html>"""
    p = Path(path)
    p.write_text(page, encoding="utf-8")
    return p
