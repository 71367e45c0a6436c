from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefixcache.analysis.trace import ByteTokenizer, TraceFormatError, TraceWriter, load_trace


def test_roundtrip_parts_tokens_prompt_and_keys(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    with TraceWriter(p, header={"tokenizer": "bytes"}) as w:
        w.segment("sys", list(range(40)))
        w.request(2.0, tenant="a", endpoint="x", parts=["sys", [7, 8]], cached_tokens=32, ttft_s=0.5, output_tokens=3)
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


@pytest.mark.parametrize(
    ("line", "msg"),
    [('{"v": 2, "ts": 1, "tokens": [1]}', "v2"), ('{"v": 1, "tokens": [1]}', "'ts'"), ("not json", "not JSON"),
     ('{"v": 1, "ts": 1, "parts": ["nope"]}', "before its definition"), ('{"v": 1, "ts": 1}', "no prompt")],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"v": 1, "ts": 0, "tokens": [1]}) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=msg) as exc:
        load_trace(p)
    assert ":2:" in str(exc.value)


def test_gzip_traces(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl.gz"
    with TraceWriter(p) as w:
        w.request(1.0, tokens=[1, 2])
    assert load_trace(p).tokens(0).tolist() == [1, 2]
