"""The audit's per-endpoint findings, priced: busting spans, prefix stability, TTL against traffic.

Each row is a JSON-ready dict (the ``endpoints`` of :meth:`AuditResult.as_dict
<prefixcache.analysis.audit.AuditResult.as_dict>`; its keys and their order are the audit's
output format). Inputs are whole-trace columns from the scan; nothing here walks requests one by
one except the sampled busting pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixcache.analysis.audit_scan import PrefixVersion, ScanResult
from prefixcache.analysis.config import AuditConfig
from prefixcache.analysis.costs import Pricing, pricing_profile
from prefixcache.analysis.trace import Trace, load_tokenizer
from prefixcache.analysis.trace.spans import Finding, Pair, find_busting


def endpoint_rows(
    trace: Trace,
    cfg: AuditConfig,
    achieved: np.ndarray,
    scan: ScanResult,
    progress: Callable[[str, int], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per endpoint of ``trace``, in endpoint order. ``achieved``: cached tokens per request.
    The tokenizer (``cfg.tokenizer``, else the trace's) is loaded only if a span needs decoding.
    Raises ValueError for an unknown ``cfg.pricing``. ``progress("endpoints", done)``."""
    pricing = pricing_profile(cfg.pricing)

    @functools.cache
    def tokenizer() -> Any:
        return load_tokenizer(cfg.tokenizer or trace.tokenizer)

    rows = []
    for endpoint, name in enumerate(trace.endpoints):
        requests = np.flatnonzero(trace.endpoint == endpoint)
        rows.append(_endpoint_row(trace, cfg, endpoint, name, requests, achieved, scan, pricing, tokenizer))
        if progress is not None:
            progress("endpoints", endpoint + 1)
    return rows


def _endpoint_row(
    trace: Trace,
    cfg: AuditConfig,
    endpoint: int,
    name: str,
    requests: np.ndarray,
    achieved: np.ndarray,
    scan: ScanResult,
    pricing: Pricing,
    tokenizer: Callable[[], Any],
) -> dict[str, Any]:
    block, ttl = cfg.block_size, cfg.ttl_s
    n_requests = len(requests)
    prompt_tokens = int(trace.prompt_tokens[requests].sum())
    usd_per_token = pricing.input_per_mtok / 1e6
    busting = _busting(trace, cfg, requests, scan, pricing, tokenizer)
    # Prefix stability: versions that served enough requests, in order of appearance.
    min_requests = max(2, int(cfg.version_min_share * n_requests))
    versions = sorted(
        (v for v in scan.versions[endpoint].values() if v.requests >= min_requests), key=lambda v: v.first_ts
    )
    prefix_tokens = scan.stable_blocks[endpoint] * block
    on_dominant = max((v.requests for v in versions), default=0)
    # TTL versus traffic.
    gap = scan.gap_s[requests]
    has_prefix = np.isfinite(gap)
    achievable = scan.achievable[requests]
    # Lost to expiry: the TTL took at least half of what an unbounded cache would have served
    # (a one-block coincidence, say two uuids sharing their first hex digits, is not a loss).
    lost = achievable - scan.within_ttl[requests]
    expired = (lost * 2 > achievable) & (lost >= 2 * block)
    lost_tokens = int(lost[expired].sum())
    # Keep-warm: one refresh per TTL of idle time between requests, against the misses it saves.
    ts = trace.ts[requests]
    idle = np.diff(ts) if len(ts) > 1 else np.zeros(0)
    refreshes = int(np.floor(idle / ttl).sum())
    refresh_cost = refreshes * prefix_tokens * pricing.read_mult
    if pricing.name != "self-hosted":
        saved = lost_tokens * (pricing.write_mult - pricing.read_mult)
    else:
        saved = lost_tokens
    keep_warm = bool(prefix_tokens > 0 and saved > refresh_cost and lost_tokens > 0)
    diverge = scan.diverge[requests]
    diverge = diverge[diverge >= 0]
    return {
        "endpoint": name,
        "tenants": sorted({trace.tenants[int(t)] for t in np.unique(trace.tenant[requests])}),
        "requests": n_requests,
        "prompt_tokens": prompt_tokens,
        "hit_rate": float(achieved[requests].sum() / prompt_tokens) if prompt_tokens else 0.0,
        "achievable_hit_rate": float(achievable.sum() / prompt_tokens) if prompt_tokens else 0.0,
        "divergence": _divergence(diverge),
        "busting": busting,
        "stable_prefix_tokens": prefix_tokens,
        "prefix_versions": len(versions),
        "dominant_prefix_share": on_dominant / n_requests if n_requests else 0.0,
        "versions": [_version_row(v, n_requests, prefix_tokens, pricing, usd_per_token) for v in versions],
        "ttl_s": ttl,
        "reuse_gap_s": {
            "p50": float(np.percentile(gap[has_prefix], 50)) if has_prefix.any() else None,
            "p90": float(np.percentile(gap[has_prefix], 90)) if has_prefix.any() else None,
            "over_ttl_share": (
                float((gap[has_prefix] >= ttl).sum() / has_prefix.sum()) if has_prefix.any() else 0.0
            ),
            "histogram": _gap_histogram(gap[has_prefix], ttl),
        },
        "ttl_expired_requests": int(expired.sum()),
        "ttl_lost_tokens": lost_tokens,
        "keep_warm": keep_warm,
        "keep_warm_prefix_tokens": prefix_tokens,
        "keep_warm_refreshes": refreshes,
        "keep_warm_cost_tokens": refresh_cost,
        "keep_warm_saved_tokens": saved,
    }


def _busting(
    trace: Trace,
    cfg: AuditConfig,
    requests: np.ndarray,
    scan: ScanResult,
    pricing: Pricing,
    tokenizer: Callable[[], Any],
) -> list[dict[str, Any]]:
    """Busting spans from a sample of (request, its most similar earlier request) pairs, spread
    over time, with what moving each below the shared content would save. None without token
    text (a trace of block hashes: its stand-in tokens would decode as noise)."""
    if not has_token_text(trace):
        return []
    reference = scan.reference
    candidates = requests[reference[requests] >= 0]
    if len(candidates):
        spread = np.linspace(0, len(candidates) - 1, min(cfg.sample_pairs, len(candidates))).astype(int)
        picked = candidates[spread]
    else:
        picked = candidates
    pairs = [
        Pair(
            int(i),
            float(trace.ts[i]),
            trace.tokens(int(i)),
            trace.tokens(int(reference[i])),
            int(scan.diverge[i]),
        )
        for i in picked
    ]
    findings = find_busting(pairs, tokenizer, min_shared=cfg.min_shared_tokens)
    return busting_rows(findings, len(requests), len(pairs), pricing)


def has_token_text(trace: Trace) -> bool:
    """Whether the trace's prompts are real tokens (not block hashes: an imported hash_ids trace
    or a keys-only trace log says ``"token_text": false`` in its header)."""
    return trace.header.get("token_text", True) is not False


#: What the audit cannot find in a trace without token text, and why (its ``unavailable_findings``).
NO_TEXT_FINDINGS = (
    "busting spans: no token text to locate and classify a variable span (timestamp, uuid, ...)",
    "divergence at token precision: only whole blocks can be compared, so 'divergence' is in "
    "multiples of the block size",
)


def busting_rows(
    findings: list[Finding], requests: int, sampled: int, pricing: Pricing
) -> list[dict[str, Any]]:
    """The busting list's rows (the audit's ``busting`` and the server's ``GET /v1/cache/report``):
    each finding over ``sampled`` pairs of an endpoint's ``requests``, with what moving the span
    below the shared content would save under ``pricing``."""
    rows = [f.as_dict(requests, sampled) for f in findings]
    usd_per_token = pricing.input_per_mtok / 1e6
    for row in rows:
        # (tokens x multiplier difference) x price, in this order: the output's floats depend on it
        for what in ("moved_below", "all_moved_below"):
            tokens_times_mult = row[f"saving_tokens_if_{what}"] * (pricing.write_mult - pricing.read_mult)
            row[f"saving_usd_if_{what}"] = tokens_times_mult * usd_per_token
    return rows


def _version_row(
    version: PrefixVersion, n_requests: int, prefix_tokens: int, pricing: Pricing, usd_per_token: float
) -> dict[str, Any]:
    return {
        "first_ts": version.first_ts,
        "last_ts": version.last_ts,
        "requests": version.requests,
        "share": version.requests / n_requests,
        "change_cost_tokens": prefix_tokens,  # one cold prefill of the new prefix per replica
        "change_cost_usd": prefix_tokens * pricing.write_mult * usd_per_token,
    }


def _divergence(diverge: np.ndarray) -> dict[str, Any]:
    """Percentiles and a 30-bin histogram of first-differing tokens (requests that had a reference)."""
    edges = np.unique(np.linspace(0, max(int(diverge.max()) if len(diverge) else 1, 1), 31).astype(int))
    counts = np.histogram(diverge, bins=edges)[0] if len(diverge) else np.zeros(len(edges) - 1)
    return {
        "p10": float(np.percentile(diverge, 10)) if len(diverge) else None,
        "p50": float(np.percentile(diverge, 50)) if len(diverge) else None,
        "p90": float(np.percentile(diverge, 90)) if len(diverge) else None,
        "histogram": {"edges": edges.tolist(), "counts": [int(c) for c in counts]},
    }


def _gap_histogram(gap: np.ndarray, ttl: float) -> dict[str, list[float]]:
    """Reuse gaps on fixed edges around the TTL (seconds); the last bin is open."""
    edges = sorted({0.0, 1.0, 10.0, 60.0, ttl / 2, ttl, 2 * ttl, 3600.0, 86400.0})
    counts, _ = np.histogram(gap, bins=[*edges, np.inf])
    return {"edges_s": edges, "counts": [int(c) for c in counts]}
