"""Ops tools: request traces, the cache audit, the trace simulator, costs and reports.

Library use (the CLI is a thin layer over these)::

    from prefixcache.analysis import load_trace, audit, AuditConfig, simulate, SimConfig
    trace = load_trace("traffic.jsonl")
    report = audit(trace, AuditConfig(ttl_s=300))          # report.as_dict() is the --json output
    result = simulate(trace, SimConfig(replicas=4, routing="cache-aware"))

No torch here: the default tokenizer (transformers) is loaded only for text prompts and for
decoding spans of traces that were not made with the byte tokenizer.
"""

from __future__ import annotations

from prefixcache.analysis.audit import AuditConfig, AuditResult, audit
from prefixcache.analysis.costs import CostModel, Pricing, cost_model, price, pricing_profile
from prefixcache.analysis.simulate import ROUTINGS, SimConfig, SimResult, simulate, sweep
from prefixcache.analysis.trace import (
    FORMAT_VERSION,
    Trace,
    TraceFormatError,
    TraceWriter,
    load_tokenizer,
    load_trace,
)
from prefixcache.analysis.trace.synth import EndpointSpec, parse_endpoint, synthesize

__all__ = [
    "FORMAT_VERSION",
    "ROUTINGS",
    "AuditConfig",
    "AuditResult",
    "CostModel",
    "EndpointSpec",
    "Pricing",
    "SimConfig",
    "SimResult",
    "Trace",
    "TraceFormatError",
    "TraceWriter",
    "audit",
    "cost_model",
    "load_tokenizer",
    "load_trace",
    "parse_endpoint",
    "price",
    "pricing_profile",
    "simulate",
    "sweep",
    "synthesize",
]
