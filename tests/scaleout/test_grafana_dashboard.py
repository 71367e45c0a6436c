"""deploy/grafana: every metric a panel (or a variable) queries is one a live server with a tier
and a live router export; the provisioning files point at the dashboard."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.cache.tiers import attach_tiers, register_prometheus
from prefixcache.router import RouterConfig, create_router_app
from prefixcache.server import create_app

from .conftest import ServerThread

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
# A metric name in PromQL: not inside a string or a label matcher (stripped first), not a
# function (followed by "("); every metric of the project starts with "prefixcache_".
METRIC = re.compile(r"\b(prefixcache_[a-zA-Z0-9_:]*)\b(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers and strings removed)."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}", "", stripped)
    return set(METRIC.findall(stripped))


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']!r}", query))
    return out


def exported_series(*texts: str) -> dict[str, str]:
    """Sample name -> family type over Prometheus texts. A histogram family ``x`` exports
    ``x_bucket``, ``x_sum`` and ``x_count`` (never ``x`` itself), a counter ``x_total``: the
    sample names are exactly what PromQL can select."""
    series: dict[str, str] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series[sample.name] = family.type
    return series


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, outcome) (rate(prefixcache_ttft_seconds_bucket{instance=~"a|b",'
        'x="prefixcache_fake"}[5m]))) / on (instance) prefixcache_queue_depth'
    )
    assert metric_names(expr) == {"prefixcache_ttft_seconds_bucket", "prefixcache_queue_depth"}
    assert metric_names("label_values(prefixcache_router_requests_total, instance)") == {
        "prefixcache_router_requests_total"
    }


@pytest.fixture
def scraped(tiny_runner: Any, tmp_path: Path) -> dict[str, str]:
    """Sample names of a tiny-model server with a disk tier and of a router in front of it,
    after one request through the router (so every labelled family has a sample)."""
    from prefixcache.engine import Engine

    engine = Engine(tiny_runner, prefill_chunk=16)
    try:
        attach_tiers(engine.cache, disk_dir=tmp_path / "disk", disk_bytes=1 << 24)
        with contextlib.ExitStack() as stack:
            app = create_app(engine, model_name="m")
            register_prometheus(engine.cache, app.state.prefixcache.metrics.registry)  # as 'serve' does
            server = stack.enter_context(ServerThread(app))
            router = stack.enter_context(ServerThread(create_router_app(RouterConfig(replicas=[server.url]))))
            body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi " * 40}]}
            assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
            texts = [httpx.get(u + "/metrics", timeout=30).text for u in (server.url, router.url)]
    finally:
        engine.close()
    return exported_series(*texts)


def test_every_dashboard_query_reads_metrics_that_exist(scraped: dict[str, str]) -> None:
    dashboard = json.loads((GRAFANA / "prefixcache.json").read_text())
    found = queries(dashboard)
    assert len(found) >= 30
    missing = []
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where}: no prefixcache metric in {expr!r}"
        missing += [f"{where}: {n}" for n in sorted(names) if n not in scraped]
    assert missing == []
    # The dashboard covers the server, its tiers and the router.
    used = {n for _, expr in found for n in metric_names(expr)}
    assert (
        "prefixcache_ttft_seconds_bucket" in used
        and scraped["prefixcache_ttft_seconds_bucket"] == "histogram"
    )
    assert any(n.startswith("prefixcache_tier_") for n in used)
    assert any(n.startswith("prefixcache_router_") for n in used)
    # The check can fail: names that a histogram or counter does not export are caught.
    for wrong in (
        "prefixcache_ttft_seconds",
        "prefixcache_prompt_tokens_bucket",
        "prefixcache_prompt_tokens",
    ):
        assert wrong not in scraped


def test_dashboard_is_provisioning_ready() -> None:
    dashboard = json.loads((GRAFANA / "prefixcache.json").read_text())
    assert dashboard["uid"] == "prefixcache" and "id" not in dashboard
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert (
            set(panel["gridPos"]) == {"h", "w", "x", "y"}
            and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        )
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and panel["targets"]
    (ds_var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["name"] == "datasource" and ds_var["query"] == "prometheus"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "prefixcache.yaml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"
