"""Fixtures of the analysis tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_traces import make_trace


@pytest.fixture(scope="session")
def scenario_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default five-endpoint scenario, 3,000 requests."""
    from prefixcache.analysis.trace.synth import DEFAULT_SCENARIO

    return make_trace(
        tmp_path_factory.mktemp("trace") / "scenario.jsonl", list(DEFAULT_SCENARIO), 3000, seed=1
    )
