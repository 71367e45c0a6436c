"""Reports of the audit and the simulator: terminal tables (``tables.py``, laid out to fit the
terminal or as markdown/CSV/JSON), the audit's tables, advice and plots (``audit.py``) and its
HTML page (``html.py``), the simulator's tables and sweep plot (``sim.py``), its checks against
the trace's measurements (``checks.py``), and the shared helpers (``common.py``)."""

from __future__ import annotations

from prefixcache.analysis.report.audit import (
    AUDIT_PLOTS,
    advice_lines,
    audit_tables,
    busting_stacks,
    fix_lines,
    plot_divergence,
    plot_gaps,
    plot_hit_rate_over_time,
    print_audit,
    save_audit_plots,
)
from prefixcache.analysis.report.common import save_png, to_json
from prefixcache.analysis.report.html import audit_html
from prefixcache.analysis.report.sim import plot_sweep, print_sim, print_sweep

__all__ = [
    "AUDIT_PLOTS",
    "advice_lines",
    "audit_html",
    "audit_tables",
    "busting_stacks",
    "fix_lines",
    "plot_divergence",
    "plot_gaps",
    "plot_hit_rate_over_time",
    "plot_sweep",
    "print_audit",
    "print_sim",
    "print_sweep",
    "save_audit_plots",
    "save_png",
    "to_json",
]
