"""When a simulation's answer is meaningless or costly: replica load and the write break-even.

* **Load.** Each replica is offered ``sum(uncached prompt tokens routed to it) / prefill_tps``
  seconds of prefill over the trace's span (first to last request). Above 100% the modelled FIFO
  queue grows without bound: the estimated TTFTs measure how long the trace is, not how fast
  the replica answers, and are marked not meaningful (``"meaningful": false``).
* **Break-even.** Under a profile that charges a cache write ``w`` and a cache read ``r`` times
  the base input price, a cacheable token read with probability ``p`` (written otherwise) costs
  ``p r + (1 - p) w`` against 1 uncached: caching pays only when ``p >= p* = (w-1)/(w-r)``
  (:func:`~prefixcache.analysis.costs.break_even_reuse`; 0.217 for Anthropic's 1.25x / 0.1x).
  Per endpoint, ``p`` is ``cached / (cached + written)`` tokens of the replay, and ``w`` the
  endpoint's writes' multiplier (5 min and 1 h classes weighted by their tokens).

Both are computed from the replay's per-request columns after it ends: the replay loop pays
nothing for them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.analysis.costs import LONG_TTL_S, break_even_reuse, pricing_profile
from prefixcache.analysis.trace import Trace


def load_rows(
    trace: Trace, replica: np.ndarray, cached: np.ndarray, replicas: int, prefill_tps: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(per replica ``{"offered_prefill_s", "utilisation", "saturated"}``, the summary
    ``{"span_s", "max_utilisation", "saturated", "warning"}``). Utilisation is None when the
    trace spans no time (one timestamp)."""
    span = float(trace.ts[-1] - trace.ts[0]) if len(trace.ts) else 0.0
    uncached = trace.prompt_tokens - cached
    offered = np.bincount(replica, weights=uncached, minlength=replicas)[:replicas] / prefill_tps
    rows = []
    for r in range(replicas):
        utilisation = float(offered[r] / span) if span > 0 else None
        rows.append(
            {
                "offered_prefill_s": float(offered[r]),
                "utilisation": utilisation,
                "saturated": utilisation is not None and utilisation > 1.0,
            }
        )
    known = [row["utilisation"] for row in rows if row["utilisation"] is not None]
    peak = max(known) if known else None
    saturated = [r for r, row in enumerate(rows) if row["saturated"]]
    warning = None
    if saturated:
        warning = (
            f"replica(s) {', '.join(map(str, saturated))} offered {peak:.0%} of their prefill capacity "
            f"({prefill_tps:g} tok/s): the queue grows without bound and the TTFT figures are not "
            "meaningful; add replicas or give the hardware's real --prefill-tps"
        )
    return rows, {"span_s": span, "max_utilisation": peak, "saturated": bool(saturated), "warning": warning}


def break_even_rows(
    trace: Trace,
    cached: np.ndarray,
    written: np.ndarray,
    profiles: tuple[str, ...],
    default_ttl_s: float,
    gpu_hour: float,
) -> list[dict[str, Any]]:
    """Per pricing profile: p* (5 min and 1 h write classes) and each endpoint's reuse
    probability against its own p*, with the input dollars caching adds (> 0: it loses money)."""
    ttl = trace.ttl_s
    long_class = np.where(np.isnan(ttl), default_ttl_s >= LONG_TTL_S, ttl >= LONG_TTL_S)
    per_endpoint = []
    for endpoint, name in enumerate(trace.endpoints):
        mine = trace.endpoint == endpoint
        per_endpoint.append(
            (
                name,
                int(cached[mine].sum()),
                int(written[mine & ~long_class].sum()),
                int(written[mine & long_class].sum()),
            )
        )
    out = []
    for profile in profiles:
        p = pricing_profile(profile, gpu_hour=gpu_hour)
        usd_per_token = p.input_per_mtok / 1e6
        rows = []
        for name, read, short, long in per_endpoint:
            writes = short + long
            w = (short * p.write_mult + long * p.write_long_mult) / writes if writes else p.write_mult
            p_star = break_even_reuse(w, p.read_mult)
            reuse = read / (read + writes) if read + writes else None
            extra = short * (p.write_mult - 1) + long * (p.write_long_mult - 1) - read * (1 - p.read_mult)
            rows.append(
                {
                    "endpoint": name,
                    "reuse_probability": reuse,
                    "break_even_reuse": p_star,
                    "loses_money": reuse is not None and reuse < p_star,
                    "extra_input_usd": extra * usd_per_token,
                }
            )
        out.append(
            {
                "profile": p.name,
                "write_mult": p.write_mult,
                "write_long_mult": p.write_long_mult,
                "read_mult": p.read_mult,
                "break_even_reuse": break_even_reuse(p.write_mult, p.read_mult),
                "break_even_reuse_1h": break_even_reuse(p.write_long_mult, p.read_mult),
                "losing_endpoints": [r["endpoint"] for r in rows if r["loses_money"]],
                "endpoints": rows,
            }
        )
    return out
