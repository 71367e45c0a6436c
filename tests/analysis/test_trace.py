from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from prefixcache.analysis.trace import (
    ByteTokenizer,
    Trace,
    TraceFormatError,
    TraceWriter,
    load_trace,
    render_messages,
)


def test_roundtrip_parts_tokens_prompt_and_keys(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    with TraceWriter(p, header={"tokenizer": "bytes"}) as w:
        w.segment("sys", list(range(40)))
        w.request(
            2.0,
            tenant="a",
            endpoint="x",
            parts=["sys", [7, 8]],
            cached_tokens=32,
            ttft_s=0.5,
            output_tokens=3,
        )
        w.request(1.0, tokens=np.arange(5))
        w.request(3.0, prompt="hi!")
        w.request(4.0, block_keys=[b"\x01" * 32, b"\x02" * 32], block_size=16, prompt_tokens=40)
    t = load_trace(p)
    assert len(t) == 4
    assert t.ts.tolist() == [1.0, 2.0, 3.0, 4.0]  # sorted by ts
    assert t.tokens(1).tolist() == list(range(40)) + [7, 8]
    assert t.tenant_name(1) == "a" and t.endpoint_name(1) == "x" and t.endpoint_name(0) == "default"
    assert t.has_cached.tolist() == [False, True, False, False] and t.cached_tokens[1] == 32
    assert np.isnan(t.ttft_s[0]) and t.ttft_s[1] == 0.5
    assert t.tokens(2).tolist() == ByteTokenizer().encode("hi!")
    keyed = t.tokens(3)
    assert len(keyed) == 40 and keyed[0] == 1 and keyed[16] == 2 and keyed[1:16].sum() == 0
    assert t.prompt_tokens.tolist() == [5, 42, 3, 40]


def test_identical_literals_are_interned(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    with TraceWriter(p) as w:
        for i in range(5):
            w.request(float(i), tokens=[1, 2, 3])
    t = load_trace(p)
    assert len(t.segments) == 1 and all(parts == (0,) for parts in t.parts)


BAD_LINES = [
    ('{"v": 2, "ts": 1, "tokens": [1]}', "v2"),
    ('{"v": 1, "tokens": [1]}', "'ts'"),
    ("not json", "not JSON"),
    ('{"v": 1, "ts": 1, "parts": ["nope"]}', "before its definition"),
    ('{"v": 1, "ts": 1, "parts": ["later"]}', "before its definition"),  # defined on a later line
    ('{"v": 1, "ts": 1}', "no prompt"),
    ("[1, 2]", "not a JSON object"),
    ('{"v": 1, "ts": 1, "parts": [[1, 2], 7]}', "list of token ids"),
    (
        '{"v": 1, "ts": 1, "block_keys": ["aa", "bb"], "block_size": 16, "prompt_tokens": 20}',
        "prompt_tokens 20",
    ),
]


@pytest.mark.parametrize(("line", "msg"), BAD_LINES)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"v": 1, "ts": 0, "tokens": [1]}) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=msg) as exc:
        load_trace(p)
    assert ":2:" in str(exc.value)


@pytest.mark.parametrize(("line", "msg"), [*BAD_LINES, (b"\xff\xfe{}", "not UTF-8")])
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_bad_lines_counted_past_blank_and_segment_lines(
    tmp_path: Path, line: str | bytes, msg: str, suffix: str
) -> None:
    # Line numbers count every line, blank ones included, in plain and gzip files alike.
    p = tmp_path / f"bad{suffix}"
    good = [
        json.dumps({"v": 1, "type": "header", "tokenizer": "bytes"}),
        json.dumps({"v": 1, "type": "segment", "id": "s", "tokens": [1, 2]}),
        "",
        "   ",
        json.dumps({"v": 1, "ts": 0, "parts": ["s", [3]]}),
    ]
    raw = "\n".join(good).encode() + b"\n" + (line if isinstance(line, bytes) else line.encode()) + b"\n"
    raw += json.dumps({"v": 1, "type": "segment", "id": "later", "tokens": [9]}).encode() + b"\n"
    p.write_bytes(gzip.compress(raw) if suffix.endswith(".gz") else raw)
    with pytest.raises(TraceFormatError, match=msg) as exc:
        load_trace(p)
    assert f"{p}:6:" in str(exc.value)


def test_segment_defined_mid_file_serves_later_requests(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    with TraceWriter(p) as w:
        w.request(1.0, tokens=[5])
        w.segment("late", [1, 2, 3])
        w.request(2.0, parts=["late", [4]])
        w.segment("late", [7])  # redefinition: later requests see the new run
        w.request(3.0, parts=["late"])
    t = load_trace(p)
    assert [t.tokens(i).tolist() for i in range(3)] == [[5], [1, 2, 3, 4], [7]]


def test_progress_every_10000_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"v": 1, "ts": i, "tokens": [i % 7]}) + "\n" for i in range(25_000)))
    seen: list[int] = []
    t = load_trace(p, progress=seen.append)
    assert seen == [10_000, 20_000] and len(t) == 25_000 and len(t.segments) == 7


def test_gzip_traces(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl.gz"
    with TraceWriter(p) as w:
        w.request(1.0, tokens=[1, 2])
    assert load_trace(p).tokens(0).tolist() == [1, 2]


# ------------------------------------------------------------------ the loader vs a plain reference
def _reference_load(path: Path) -> Trace:
    """The format as the module docstring states it, parsed line by line with the stdlib json
    module and no tricks: what the fast loader must reproduce exactly."""
    segments: list[list[int]] = []
    seg_ids: dict[tuple[int, ...], int] = {}
    named: dict[str, int] = {}
    text_ids: dict[str, int] = {}
    key_ids: dict[str, int] = {}
    tenants: dict[str, int] = {}
    endpoints: dict[str, int] = {}
    rows: list[dict] = []
    header: dict = {}
    tok = ByteTokenizer()

    def intern(tokens: list[int]) -> int:
        key = tuple(int(x) for x in tokens)
        if key not in seg_ids:
            seg_ids[key] = len(segments)
            segments.append(list(key))
        return seg_ids[key]

    def text(key: str, render) -> int:
        if key not in text_ids:
            text_ids[key] = intern(tok.encode(render()))
        return text_ids[key]

    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        kind = obj.get("type", "request")
        if kind == "header":
            header = obj
            continue
        if kind == "segment":
            named[obj["id"]] = intern(obj["tokens"])
            continue
        if "tokens" in obj:
            parts = (intern(obj["tokens"]),)
        elif "parts" in obj:
            parts = tuple(named[p] if isinstance(p, str) else intern(p) for p in obj["parts"])
        elif "prompt" in obj:
            parts = (text("p" + json.dumps(obj["prompt"]), lambda o=obj: o["prompt"]),)
        elif "messages" in obj:
            parts = (
                text(
                    "m" + json.dumps(obj["messages"], sort_keys=True),
                    lambda o=obj: render_messages(o["messages"]),
                ),
            )
        else:
            bs, keys = obj.get("block_size", 16), obj["block_keys"]
            stand_in = [0] * obj.get("prompt_tokens", len(keys) * bs)
            for i, k in enumerate(keys):
                stand_in[i * bs] = key_ids.setdefault(k, len(key_ids) + 1)
            stand_in[len(keys) * bs :] = [0xFFFFFFFF] * (len(stand_in) - len(keys) * bs)
            parts = (intern(stand_in),)
        ttl = obj.get("ttl")
        rows.append(
            {
                "ts": float(obj["ts"]),
                "tenant": tenants.setdefault(obj.get("tenant") or "default", len(tenants)),
                "endpoint": endpoints.setdefault(obj.get("endpoint") or "default", len(endpoints)),
                "parts": parts,
                "prompt": sum(len(segments[j]) for j in parts),
                "out": obj.get("output_tokens") or 0,
                "cached": obj.get("cached_tokens") or 0,
                "has": obj.get("cached_tokens") is not None,
                "ttft": float("nan") if obj.get("ttft_s") is None else obj["ttft_s"],
                "ttl": float(ttl) if isinstance(ttl, int | float) else float("nan"),
            }
        )
    rows.sort(key=lambda r: r["ts"])  # stable, like the loader's argsort
    col = lambda k, dt: np.array([r[k] for r in rows], dtype=dt)  # noqa: E731
    return Trace(
        ts=col("ts", np.float64),
        tenant=col("tenant", np.int32),
        endpoint=col("endpoint", np.int32),
        parts=[r["parts"] for r in rows],
        segments=[np.array(s, dtype=np.uint32) for s in segments],
        prompt_tokens=col("prompt", np.int64),
        output_tokens=col("out", np.int64),
        cached_tokens=col("cached", np.int64),
        has_cached=col("has", bool),
        ttft_s=col("ttft", np.float64),
        ttl_s=col("ttl", np.float64),
        tenants=list(tenants),
        endpoints=list(endpoints),
        tokenizer=header.get("tokenizer"),
        header=header,
    )


def _assert_same_trace(got: Trace, want: Trace) -> None:
    for name in Trace.__slots__:
        a, b = getattr(got, name), getattr(want, name)
        if name == "segments":
            assert len(a) == len(b)
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert x.dtype == np.uint32 and x.ndim == 1 and x.tolist() == y.tolist(), f"segment {i}"
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert np.array_equal(a, b, equal_nan=b.dtype.kind == "f"), name
        else:
            assert a == b, name


def _mixed_trace(path: Path, n: int = 400, seed: int = 3) -> None:
    rng = np.random.default_rng(seed)
    sys_a, sys_b = rng.integers(0, 50_000, 120).tolist(), rng.integers(0, 50_000, 70).tolist()
    lines: list[dict | str] = [
        {"v": 1, "type": "header", "tokenizer": "bytes", "note": "x"},
        {"v": 1, "type": "segment", "id": "a", "tokens": sys_a},
        {"v": 1, "type": "segment", "id": "empty", "tokens": []},
    ]
    for i in range(n):
        if i == n // 2:  # a segment first defined mid-file, and one redefined
            lines.append({"v": 1, "type": "segment", "id": "b", "tokens": sys_b})
            lines.append({"v": 1, "type": "segment", "id": "a", "tokens": sys_b[:9]})
            lines.append("")
        obj: dict = {
            "v": 1,
            "ts": round(float(rng.uniform(0, 100)), 3) if i % 5 else float(i % 7),
        }  # ties, unsorted
        if i % 3:
            obj["tenant"] = ["t0", "t1", "t2"][i % 3]
        if i % 4:
            obj["endpoint"] = f"e{i % 6}"
        user = rng.integers(0, 300, int(rng.integers(0, 40))).tolist()
        kind = i % 7
        if kind == 0:
            obj["tokens"] = sys_a[:30] + user
        elif kind == 1:
            obj["tokens"] = [1, 2, 3]  # repeated: one segment
        elif kind == 2:
            obj["parts"] = ["a", user, "empty", [5, 6]] + (["b"] if i > n // 2 else [])
        elif kind == 3:
            obj["prompt"] = f"hello {i % 4} \u00e9\u4e16"
        elif kind == 4:
            obj["messages"] = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"q{i % 3}"},
            ]
        elif kind == 5:
            keys = [f"{k:064x}" for k in rng.integers(0, 5, int(rng.integers(1, 4)))]
            obj.update(block_keys=keys, block_size=4, prompt_tokens=len(keys) * 4 + int(rng.integers(0, 3)))
        else:
            obj["parts"] = [[], user, sys_a[:5]]
        if i % 2:
            obj["cached_tokens"] = int(rng.integers(0, 100))
        if i % 3 == 0:
            obj["ttft_s"] = round(float(rng.uniform(0, 2)), 4)
        if i % 5 == 1:
            obj["ttl"] = [300, 3600.5, "1h", None][i % 4]
        if i % 6:
            obj["output_tokens"] = int(rng.integers(1, 500))
        obj["ignored_field"] = {"nested": [1, 2]}
        lines.append(obj)
    with open(path, "w") as fh:
        for obj in lines:
            fh.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")


def test_loader_matches_a_plain_reference_parse(tmp_path: Path) -> None:
    p = tmp_path / "mixed.jsonl"
    _mixed_trace(p)
    want = _reference_load(p)
    assert not np.all(
        np.diff([json.loads(ln)["ts"] for ln in p.read_text().splitlines() if '"ts"' in ln]) >= 0
    )
    got = load_trace(p)
    _assert_same_trace(got, want)
    assert len(got) == 400 and got.tokens(0).dtype == np.uint32
    gz = tmp_path / "mixed.jsonl.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    _assert_same_trace(load_trace(gz), want)


def test_odd_token_values_behave_as_numpy_says(tmp_path: Path) -> None:
    # Not plain uint32 ints: floats truncate (numpy's conversion, as before), out-of-range ids raise.
    p = tmp_path / "t.jsonl"
    p.write_text('{"v":1,"ts":1,"tokens":[1.9, 2, true]}\n{"v":1,"ts":2,"parts":[[1, 2, 1]]}\n')
    t = load_trace(p)
    assert t.parts == [(0,), (0,)] and t.tokens(0).tolist() == [1, 2, 1]
    p.write_text('{"v":1,"ts":1,"tokens":[4294967296]}\n')
    with pytest.raises(OverflowError):
        load_trace(p)


def test_a_last_line_torn_by_a_crash_is_skipped_with_a_warning(tmp_path, caplog) -> None:
    from prefixcache.analysis.trace import TraceFormatError, load_trace
    from prefixcache.analysis.trace.synth import parse_endpoint, synthesize

    path = tmp_path / "t.jsonl"
    synthesize(path, [parse_endpoint("ep:rate=2,system=100")], requests=20)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 40])  # the writer stopped mid-line
    trace = load_trace(path)
    assert len(trace) == 19 and "cut short" in caplog.text
    # A broken line that is not the last is still refused, naming it.
    lines = whole.splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:5], lines[5][:30] + b"\n", *lines[6:]]))
    with pytest.raises(TraceFormatError, match=":6: not JSON"):
        load_trace(path)
