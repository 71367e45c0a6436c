"""Builders of small synthetic traces with known answers (shared by the analysis tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefixcache.analysis.trace import TraceWriter
from prefixcache.analysis.trace.synth import parse_endpoint, synthesize


def make_trace(path: Path, specs: list[str], requests: int, seed: int = 0) -> Path:
    synthesize(path, [parse_endpoint(s) for s in specs], requests=requests, seed=seed)
    return path


def fixed_gap_trace(path: Path, *, sys_tokens: int = 1024, user_tokens: int = 32) -> Path:
    """Two endpoints of one tenant with fixed gaps: 'busy' every 1 s (200 requests) and 'quiet'
    every 900 s (8 requests), each with its own system prompt and a unique user tail."""
    rng = np.random.default_rng(0)
    with TraceWriter(path, header={"tokenizer": "bytes"}) as w:
        w.segment("busy-sys", rng.integers(97, 123, sys_tokens))
        w.segment("quiet-sys", rng.integers(97, 123, sys_tokens))
        events = [(float(i), "busy") for i in range(200)] + [(0.5 + 900.0 * i, "quiet") for i in range(8)]
        for t, ep in sorted(events):
            w.request(
                t,
                endpoint=ep,
                parts=[f"{ep}-sys", rng.integers(97, 123, user_tokens).tolist()],
                output_tokens=10,
            )
    return path
