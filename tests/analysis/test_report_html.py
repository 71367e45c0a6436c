"""The audit's HTML report carries what the terminal report says: every fix line with its
savings in tokens and dollars, the busting table with both savings, the prefix-stability and
keep-warm advice, the plots; the raw JSON in a collapsed section. Rendered by real headless
Chromium (its DOM read back, and a screenshot taken)."""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path

from analysis_traces import make_trace
from rich.console import Console

from prefixcache.analysis.audit import AuditConfig, audit
from prefixcache.analysis.report import advice_lines, audit_html, fix_lines, print_audit
from prefixcache.analysis.trace import load_trace

SPECS = [
    "support:rate=2,system=1600,bust=timestamp+counter,tenant=acme",
    "search:rate=1,system=800,bust=uuid,bust_at=middle",
    "quiet:rate=0.002,system=2000",
]


def test_html_report_says_what_the_terminal_says(tmp_path: Path, browse) -> None:
    trace = load_trace(make_trace(tmp_path / "t.jsonl", SPECS, 3000, seed=1))
    res = audit(trace, AuditConfig())
    fixes, advice = fix_lines(res), advice_lines(res)
    assert len(fixes) == 2 and any("keep warm" in line for _, line in advice)
    page = audit_html(res, tmp_path / "audit.html")

    dom = browse(page.as_uri())  # what Chromium rendered, as text
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom.html.split("<details>")[0])).split())
    for name, line in fixes + advice:
        assert line in text and name in text, line
    assert "$" in " ".join(line for _, line in fixes)
    # Both savings of every busting row, as the terminal prints them.
    out = io.StringIO()
    print_audit(res, Console(file=out, width=300, color_system=None))
    terminal = " ".join(out.getvalue().split())
    for e in res.endpoints:
        for b in e["busting"]:
            for what in ("moved_below", "all_moved_below"):
                cell = f"{b[f'saving_tokens_if_{what}']:,.0f} tok (${b[f'saving_usd_if_{what}']:,.2f})"
                assert cell in text and cell in terminal
    assert "Keep-warm" in text and "quiet" in text
    assert raw_count(page, "data:image/png;base64,") == 3
    # The raw JSON is there, collapsed, and is the audit's --json.
    raw = page.read_text()
    assert "<details><summary>Raw JSON" in raw
    start = raw.index("<pre>") + len("<pre>")
    data = json.loads(html.unescape(raw[start : raw.index("</pre>", start)]))
    assert data["requests"] == len(res.ts) and [e["endpoint"] for e in data["endpoints"]] == [
        e["endpoint"] for e in res.endpoints
    ]

    shot = tmp_path / "audit.png"
    browse.screenshot(page.as_uri(), shot, size="1200,2600")
    assert shot.stat().st_size > 50_000


def raw_count(page: Path, needle: str) -> int:
    return page.read_text().count(needle)
