"""``prefixcache trace import`` on small fixtures written by hand in each format
(tests/analysis/fixtures/), and the imported traces through ``audit`` and ``simulate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache.analysis.audit import AuditConfig, audit
from prefixcache.analysis.config import SimConfig
from prefixcache.analysis.simulate import simulate
from prefixcache.analysis.trace import TraceFormatError, load_trace
from prefixcache.analysis.trace.importers import import_trace
from prefixcache.cli import app

FIXTURES = Path(__file__).parent / "fixtures"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _hand_replay(path: Path, block: int) -> tuple[list[int], int]:
    """An infinite cache of hash_ids prefixes, by hand: per request (in time order, ties in file
    order) the longest cached run of leading full blocks, capped so that one prompt token is
    left to compute; then its full blocks are cached. (Cached tokens per request, prompt tokens.)"""
    rows = sorted(_lines(path), key=lambda r: r["timestamp"])
    seen: set[tuple[int, ...]] = set()
    cached = []
    for r in rows:
        ids, n = r["hash_ids"], r["input_length"]
        full = min(len(ids), n // block)
        cap = (n - 1) // block
        hit = 0
        while hit < min(full, cap) and tuple(ids[: hit + 1]) in seen:
            hit += 1
        cached.append(hit * block)
        seen.update(tuple(ids[: k + 1]) for k in range(full))
    return cached, sum(r["input_length"] for r in rows)


def test_mooncake_import_and_its_hit_rate_match_a_replay_by_hand(tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    res = import_trace("mooncake", FIXTURES / "mooncake.jsonl", out)
    assert (res.requests, res.block_size, res.token_text) == (9, 512, False)
    header, *requests = _lines(out)
    assert header == {"v": 1, "type": "header", "source": "mooncake", "block_size": 512, "token_text": False}
    assert [r["ts"] for r in requests] == [0.0, 1.5, 3.0, 3.0, 5.2, 7.0, 9.1, 12.0, 15.5]  # ms -> s, sorted
    assert [len(r["block_keys"]) for r in requests] == [2, 2, 3, 3, 4, 1, 0, 5, 1]  # full blocks only
    # Chained: a shared id at the same depth after the same ids is the same key, else not.
    assert requests[0]["block_keys"][:2] == requests[1]["block_keys"][:2]
    assert requests[5]["block_keys"][0] != requests[0]["block_keys"][0]
    expected, prompt = _hand_replay(FIXTURES / "mooncake.jsonl", 512)
    assert expected == [0, 1024, 1024, 1024, 1536, 0, 0, 2048, 512]  # (the hand replay, checked by eye)
    trace = load_trace(out)
    sim = simulate(trace, SimConfig(block_size=512))
    assert sim.cached.tolist() == expected
    assert sim.hit_rate == sum(expected) / prompt
    assert trace.output_tokens.tolist() == [50, 20, 30, 30, 80, 10, 5, 64, 12]


def test_qwen_bailian_import_keeps_16_token_blocks_and_types_as_endpoints(tmp_path: Path) -> None:
    out = tmp_path / "q.jsonl"
    import_trace("qwen-bailian", FIXTURES / "qwen_bailian.jsonl", out)
    header, *requests = _lines(out)
    assert (header["block_size"], header["token_text"]) == (16, False)
    assert [r["endpoint"] for r in requests] == ["text", "search", "text", "text", "image", "search"]
    assert [r["ts"] for r in requests] == [0.512, 1.0, 3.25, 7.5, 8.0, 9.75]  # already seconds
    assert [len(r["block_keys"]) for r in requests] == [2, 2, 4, 6, 2, 3]
    expected, prompt = _hand_replay(FIXTURES / "qwen_bailian.jsonl", 16)
    assert expected == [0, 0, 32, 64, 0, 32]
    sim = simulate(load_trace(out), SimConfig(block_size=16))
    assert sim.cached.tolist() == expected


def test_audit_of_a_hash_ids_trace_says_which_findings_it_cannot_make(tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    import_trace("mooncake", FIXTURES / "mooncake.jsonl", out)
    res = audit(load_trace(out), AuditConfig(block_size=512))
    d = res.as_dict()
    assert [u.split(":")[0] for u in d["unavailable_findings"]] == [
        "busting spans",
        "divergence at token precision",
    ]
    assert all(e["busting"] == [] for e in d["endpoints"])
    runner = CliRunner()
    table = runner.invoke(app, ["audit", str(out)], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "not available from this trace: busting spans" in table.output
    assert "block 512" in table.output  # the header's block size is the default
    js = runner.invoke(app, ["audit", str(out), "--json"])
    assert json.loads(js.stdout)["unavailable_findings"] == d["unavailable_findings"]
    wrong = runner.invoke(app, ["simulate", str(out), "--block-size", "16"])
    assert wrong.exit_code == 2 and "blocks are 512 tokens" in wrong.output
    sim = runner.invoke(app, ["simulate", str(out), "--json"])
    assert json.loads(sim.stdout)["config"]["block_size"] == 512
    # A trace with token text has no such list (and its JSON is as before).
    plain = audit(load_trace(FIXTURES / "trace_log.jsonl"), AuditConfig()).as_dict()
    assert "unavailable_findings" not in plain


def test_openai_bodies_import_with_their_timestamps(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    res = import_trace("openai", FIXTURES / "openai_bodies.jsonl", out, tokenizer="bytes")
    assert (res.requests, res.token_text) == (3, True)
    header, *requests = _lines(out)
    assert header == {"v": 1, "type": "header", "source": "openai", "tokenizer": "bytes"}
    assert [r["ts"] for r in requests] == [1764590400.0, 1764590401.5, 1764590403.0]
    assert [r["endpoint"] for r in requests] == ["/v1/chat/completions"] * 3
    assert [r["output_tokens"] for r in requests] == [16, 16, 8]
    assert requests[2]["messages"][1]["content"] == [{"type": "text", "text": "And a block?"}]
    trace = load_trace(out)
    assert len(trace) == 3 and trace.prompt_tokens.min() > 0


def test_anthropic_bodies_render_system_and_tools_first(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    import_trace("anthropic", FIXTURES / "anthropic_bodies.jsonl", out, tokenizer="bytes")
    _, first, second = _lines(out)
    assert (first["ts"], second["ts"]) == (10.0, 20.0)  # sorted
    assert first["endpoint"] == second["endpoint"] == "support"
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    tools, system, user = second["messages"]
    assert tools["content"].startswith('Tools: [{"name":"lookup_order"')
    assert system["content"][0]["text"] == "You are the support assistant of a bicycle shop."
    assert user == {"role": "user", "content": "Where is order 42?"}


def test_a_missing_timestamp_names_the_flags_that_supply_one(tmp_path: Path) -> None:
    src = FIXTURES / "openai_no_timestamps.jsonl"
    with pytest.raises(
        TraceFormatError, match=r"openai_no_timestamps.jsonl:1: no timestamp field 'timestamp'"
    ):
        import_trace("openai", src, tmp_path / "x.jsonl")
    runner = CliRunner()
    bad = runner.invoke(app, ["trace", "import", "--from", "openai", str(src), str(tmp_path / "x.jsonl")])
    assert bad.exit_code == 2
    assert "--timestamp-field" in bad.output and "--interval-ms" in bad.output
    ok = runner.invoke(
        app,
        ["trace", "import", "--from", "openai", "--interval-ms", "250", str(src), str(tmp_path / "y.jsonl")],
    )
    assert ok.exit_code == 0, ok.output
    assert "wrote 3 requests" in ok.output
    assert [r["ts"] for r in _lines(tmp_path / "y.jsonl")[1:]] == [0.0, 0.25, 0.5]
    unknown = runner.invoke(app, ["trace", "import", "--from", "vllm", str(src), str(tmp_path / "z.jsonl")])
    assert unknown.exit_code == 2 and "mooncake" in unknown.output


def test_server_trace_logs_are_sorted_and_keys_only_ones_flagged(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    res = import_trace("trace-log", FIXTURES / "trace_log.jsonl", out)
    header, *requests = _lines(out)
    assert header == {"v": 1, "type": "header", "source": "trace-log", "tokenizer": "bytes"}
    assert [r["ts"] for r in requests] == [1764450001.0, 1764450002.5]
    assert res.token_text is True
    keys = tmp_path / "k.jsonl"
    res = import_trace("trace-log", FIXTURES / "trace_log_keys_only.jsonl", keys)
    assert (res.token_text, res.block_size) == (False, 16)
    assert audit(load_trace(keys), AuditConfig()).as_dict()["unavailable_findings"]
    with pytest.raises(
        TraceFormatError, match=r"openai_no_timestamps.jsonl:1: needs 'timestamp' \(int or float\)"
    ):
        import_trace("mooncake", FIXTURES / "openai_no_timestamps.jsonl", tmp_path / "e.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests found; is this a qwen-bailian trace"):
        import_trace("qwen-bailian", tmp_path / "empty.jsonl", tmp_path / "e.jsonl")
