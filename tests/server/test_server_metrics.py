"""/metrics parses as Prometheus text and moves exactly as the requests say; the trace log is
readable by the ops tools' loader."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.analysis.trace import load_trace

MODEL = "test-model"
SYSTEM = "Metrics must add up to exactly what the responses reported, token for token. " * 6


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics").text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_move_as_the_requests_say(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    before = scrape(server.url)
    assert before[("prefixcache_prompt_tokens_total", ())] == 0
    usages = []
    for q in ("one", "two"):
        r = oa.chat.completions.create(
            model=MODEL,
            max_tokens=3,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        )
        u = r.usage
        usages.append(
            (
                u.prompt_tokens,
                u.prompt_tokens_details.cached_tokens,
                u.prompt_tokens_details.cache_write_tokens,
                u.completion_tokens,
            )
        )
    m = an.messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": "three"}]
    )
    mu = m.usage
    usages.append(
        (
            mu.input_tokens + mu.cache_read_input_tokens + mu.cache_creation_input_tokens,
            mu.cache_read_input_tokens,
            mu.cache_creation_input_tokens,
            mu.output_tokens,
        )
    )
    bad = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert bad.status_code == 400
    after = scrape(server.url)
    totals = [sum(u[i] for u in usages) for i in range(4)]
    names = ["prompt_tokens", "cached_tokens", "cache_write_tokens", "completion_tokens"]
    for name, total in zip(names, totals, strict=True):
        assert after[(f"prefixcache_{name}_total", ())] == total, name
    req = "prefixcache_requests_total"
    assert after[(req, (("route", "/v1/chat/completions"), ("status", "200")))] == 2
    assert after[(req, (("route", "/v1/messages"), ("status", "200")))] == 1
    assert after[(req, (("route", "/v1/chat/completions"), ("status", "400")))] == 1
    ttft = {
        o: after[("prefixcache_ttft_seconds_count", (("outcome", o),))] for o in ("hit", "partial", "miss")
    }
    assert sum(ttft.values()) == 3 and ttft["miss"] == 1
    stats = server.engine.cache.stats()
    assert after[("prefixcache_cache_blocks", ())] == stats.blocks == len(server.engine.cache.store)
    assert after[("prefixcache_cache_bytes", ())] == stats.bytes
    assert after[("prefixcache_cache_hit_ratio", ())] == totals[1] / totals[0]
    assert after[("prefixcache_evictions_total", (("reason", "ttl"),))] == 0
    assert after[("prefixcache_prefill_seconds_saved_total", ())] > 0
    assert after[("prefixcache_queue_depth", ())] == 0
    # Flushing shows up as evictions by reason.
    httpx.delete(server.url + "/v1/cache")
    flushed = scrape(server.url)
    assert flushed[("prefixcache_evictions_total", (("reason", "flush"),))] == stats.blocks
    assert flushed[("prefixcache_cache_blocks", ())] == 0


def test_trace_log_lines_load_in_the_ops_tools(serve, make_engine, tmp_path):
    path = tmp_path / "trace.jsonl"
    server = serve(make_engine(), model_name=MODEL, trace_log=path, api_keys={"k": "acme"})
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    r1 = oa.chat.completions.create(
        model=MODEL, max_tokens=2, messages=msgs, extra_headers={"X-Prefixcache-Endpoint": "support-bot"}
    )
    r2 = oa.completions.create(
        model=MODEL,
        prompt="plain text prompt",
        max_tokens=2,
        extra_body={"prompt_cache_retention": "24h", "prompt_cache_key": "docs-bot"},
    )
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    layout = server.engine.block_layout
    assert (header["type"], header["dtype"]) == ("header", layout.dtype)  # the KV dtype it computes in
    assert [line["endpoint"] for line in lines] == ["support-bot", "/v1/completions"]
    assert all(line["v"] == 1 and line["tenant"] == "acme" for line in lines)
    assert lines[0]["tokens"] == server.engine.render_ids(msgs)
    assert lines[0]["prompt_tokens"] == r1.usage.prompt_tokens == len(lines[0]["tokens"])
    assert lines[1]["cache_write_tokens"] == r2.usage.prompt_tokens_details.cache_write_tokens
    assert lines[1]["ttl"] == 86400.0
    assert lines[1]["prompt_cache_key"] == "docs-bot" and "prompt_cache_key" not in lines[0]
    assert "messages" not in lines[0] and "prompt" not in lines[1]  # no text without --trace-text
    trace = load_trace(path)
    assert len(trace) == 2
    assert trace.endpoint_name(0) == "support-bot" and trace.tenant_name(0) == "acme"
    assert trace.tokens(0).tolist() == lines[0]["tokens"]
    assert int(trace.cached_tokens[0]) == r1.usage.prompt_tokens_details.cached_tokens


def test_trace_text_only_when_asked(serve, make_engine, tmp_path):
    path = tmp_path / "trace.jsonl"
    server = serve(make_engine(), model_name=MODEL, trace_log=path, trace_text=True)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    oa.completions.create(model=MODEL, prompt="visible text", max_tokens=1)
    line = json.loads(path.read_text().splitlines()[-1])
    assert line["prompt"] == "visible text" and line["tokens"]
