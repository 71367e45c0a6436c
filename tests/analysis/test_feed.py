"""The streamed trace (a reader process): what it serves is what loading gives, in time order,
with the same keys; the audit and simulator fed by it give what they give on the loaded trace;
traces out of order beyond the reader's window, bad lines and a dead reader are handled."""

from __future__ import annotations

import functools
import gzip
import importlib
import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import numpy as np
import orjson
import pytest

from prefixcache.analysis.audit import AuditConfig, audit_file
from prefixcache.analysis.simulate import SimConfig, simulate, simulate_file
from prefixcache.analysis.trace import TraceFormatError, TraceWriter, load_trace
from prefixcache.analysis.trace.keychains import KeyChains

feed_mod = importlib.import_module("prefixcache.analysis.feed")
reader_mod = importlib.import_module("prefixcache.analysis.feed_reader")
audit_mod = importlib.import_module("prefixcache.analysis.audit")

pytestmark = pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="streams need fork")

FP, B = "feed-test", 16


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many batches (the reader is forked, so it sees the patched module), and a tiny key-state
    bound so the reader drops trie nodes and the receiver must forget them in step."""
    monkeypatch.setattr(reader_mod, "CHUNK_LINES", 97)
    for mod in (feed_mod, reader_mod):
        monkeypatch.setattr(mod, "KeyChains", functools.partial(KeyChains, max_states=40))


def _rewrite(src: Path, dst: Path, fn) -> Path:
    """Copy a trace, passing each request object through ``fn(index, obj)``."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        i = 0
        for line in f:
            obj = orjson.loads(line)
            if "ts" in obj:
                fn(i, obj)
                i += 1
            g.write(orjson.dumps(obj) + b"\n")
    return dst


def _jittered(src: Path, dst: Path) -> Path:
    """Timestamps moved later by up to 3 s: lines out of time order by a few dozen lines."""
    rng = np.random.default_rng(5)

    def fn(_i: int, obj: dict) -> None:
        obj["ts"] += float(rng.uniform(0, 3))

    return _rewrite(src, dst, fn)


def _read_all(path: Path) -> tuple[list[list[bytes]], object]:
    [feed] = feed_mod.stream(path, fingerprint=FP, block_size=B)
    with feed:
        keys = list(feed)
        return keys, feed.trace()


def _same_trace(a, b) -> None:
    for name in (
        "ts",
        "tenant",
        "endpoint",
        "prompt_tokens",
        "output_tokens",
        "cached_tokens",
        "has_cached",
        "ttft_s",
        "ttl_s",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    assert a.parts == b.parts and a.tenants == b.tenants and a.endpoints == b.endpoints
    assert a.header == b.header and a.tokenizer == b.tokenizer
    assert len(a.segments) == len(b.segments) and all(
        np.array_equal(x, y) for x, y in zip(a.segments, b.segments, strict=True)
    )


@pytest.mark.parametrize("jitter", [False, True], ids=["sorted", "jittered"])
def test_stream_serves_the_loaded_trace_in_time_order_with_the_same_keys(
    scenario_trace: Path, tmp_path: Path, small_chunks: None, jitter: bool
) -> None:
    path = _jittered(scenario_trace, tmp_path / "j.jsonl") if jitter else scenario_trace
    keys, streamed = _read_all(path)
    loaded = load_trace(path)
    if jitter:
        assert not np.all(
            np.diff([json.loads(x)["ts"] for x in path.read_text().splitlines() if '"ts"' in x]) >= 0
        )
    _same_trace(streamed, loaded)
    assert keys == list(feed_mod.TraceFeed.of(loaded, FP, B))
    assert len(keys) == len(loaded) and sum(map(len, keys)) > 0


def test_text_prompts_and_gzip_stream_like_they_load(tmp_path: Path, small_chunks: None) -> None:
    p = tmp_path / "t.jsonl.gz"
    sys_prompt = "You are a careful assistant. " * 20
    with TraceWriter(p, header={"tokenizer": "bytes"}) as w:
        for i in range(300):
            if i % 2:
                w.request(float(i), tenant=f"t{i % 3}", prompt=sys_prompt + f"question {i}")
            else:
                w.request(
                    float(i),
                    endpoint="chat",
                    messages=[
                        {"role": "system", "content": sys_prompt},
                        {"role": "user", "content": f"hi {i}"},
                    ],
                    ttl=3600,
                )
    with gzip.open(p, "rb") as fh:
        assert fh.read(1)  # really compressed
    keys, streamed = _read_all(p)
    loaded = load_trace(p)
    _same_trace(streamed, loaded)
    assert keys == list(feed_mod.TraceFeed.of(loaded, FP, B))


def test_simulate_file_gives_what_simulate_of_the_loaded_trace_gives(
    scenario_trace: Path, tmp_path: Path, small_chunks: None
) -> None:
    path = _jittered(scenario_trace, tmp_path / "j.jsonl")
    loaded = load_trace(path)
    for cfg in (
        SimConfig(capacity_bytes=64 << 20, ttl_s=30),
        SimConfig(replicas=3, routing="cache-aware", align_tokens=64),
        SimConfig(replicas=2, routing="prefix-affinity"),
    ):
        seen: list[tuple[str, float, float]] = []
        a = simulate_file(path, cfg, progress=lambda *x: seen.append(x))  # noqa: B023
        b = simulate(loaded, cfg)
        assert a.as_dict() == b.as_dict()
        for f in ("cached", "written", "replica", "ttft_s"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
        assert seen and {s for s, _, _ in seen} == {"simulating"} and seen[-1][2] == path.stat().st_size


def _no_loading(*_a: object, **_k: object) -> None:
    raise AssertionError("streamed, not loaded")


def test_audit_file_scans_and_replays_the_stream_like_the_loaded_trace(
    scenario_trace: Path, tmp_path: Path, small_chunks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_audit import _same

    path = _jittered(scenario_trace, tmp_path / "j.jsonl")
    loaded = load_trace(path)
    monkeypatch.setattr(audit_mod, "load_trace", _no_loading)
    for cfg in (AuditConfig(ttl_s=30), AuditConfig(ttl_s=300, align_tokens=64, always_replay=True)):
        a = audit_file(path, cfg)  # the scan alone; the scan with a replay child beside it
        assert a.achieved_source.startswith("replay" if cfg.always_replay else "PrefixCache")
        assert a.achieved.sum() > 0
        _same(a, audit_mod.audit(loaded, cfg))


def test_a_trace_out_of_order_beyond_the_window_is_loaded_whole_instead(
    scenario_trace: Path, tmp_path: Path, small_chunks: None
) -> None:
    def fn(i: int, obj: dict) -> None:
        if i == 2000:
            obj["ts"] -= 3600.0  # an hour early, ~2,000 lines late

    path = _rewrite(scenario_trace, tmp_path / "late.jsonl", fn)
    with pytest.raises(feed_mod.TraceUnsorted, match=r"line 20\d\d"):
        _read_all(path)
    loaded = load_trace(path)
    cfg = SimConfig()
    assert simulate_file(path, cfg).as_dict() == simulate(loaded, cfg).as_dict()
    from test_audit import _same

    _same(audit_file(path, AuditConfig()), audit_mod.audit(loaded, AuditConfig()))


def test_a_bad_line_is_reported_with_its_number(
    scenario_trace: Path, tmp_path: Path, small_chunks: None
) -> None:
    lines = scenario_trace.read_bytes().splitlines(keepends=True)
    lines[1500] = b'{"v": 1, "ts": 5, "tokens": [1, 2,\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1501: not JSON"):
        simulate_file(path, SimConfig())
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1501: not JSON"):
        audit_file(path, AuditConfig())
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"v": 1, "type": "header", "tokenizer": "bytes"}\n')
    with pytest.raises(TraceFormatError, match="no request lines"):
        simulate_file(empty, SimConfig())


def test_a_dead_reader_is_an_error_not_a_hang(scenario_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = reader_mod._read

    def dies(path, tokenizer, block_size, fingerprint, send):  # noqa: ANN001
        def send_then_die(kind, msg):  # noqa: ANN001
            send(kind, msg)
            os.kill(os.getpid(), signal.SIGKILL)  # after the first batch

        real(path, tokenizer, block_size, fingerprint, send_then_die)

    monkeypatch.setattr(reader_mod, "_read", dies)
    with pytest.raises(RuntimeError, match="trace reader process stopped"):
        simulate_file(scenario_trace, SimConfig())


def test_the_audit_takes_measured_cached_tokens_without_starting_a_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "m.jsonl"
    with TraceWriter(p) as w:
        for i in range(40):
            w.request(float(i), tokens=list(range(100)) + [i], cached_tokens=48 if i else 0)

    def no_replay(*_a: object, **_k: object) -> None:
        raise AssertionError("no replay child for a trace that measured its cached tokens")

    monkeypatch.setattr(audit_mod._ReplayChild, "start", no_replay)
    res = audit_file(p, AuditConfig())
    assert res.achieved_source == "trace cached_tokens"
    assert res.hit_rate == pytest.approx(39 * 48 / (40 * 101))
