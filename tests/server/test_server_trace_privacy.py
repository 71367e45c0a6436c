"""The trace log (issue 11, item 7): created 0600 in directories created 0700; a keys-only mode
that writes salted block keys and no text or token ids, which the audit tools still replay."""

from __future__ import annotations

import json
import os
import stat

import httpx
import pytest

from prefixcache.analysis.trace import load_trace
from prefixcache.server.ops.tracelog import TraceLog, trace_keys

MODEL = "test-model"
KEYS = {"sk-a": "alpha", "sk-b": "beta"}
SYSTEM = "A shared system prompt, long enough for several blocks. " * 4


def _mode(path: os.PathLike[str]) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _chat(url: str, key: str, question: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"x-api-key": key})


def test_the_trace_file_is_0600_and_its_new_directories_0700(tmp_path):
    old = os.umask(0o022)  # a usual umask: without the explicit modes files would be 0644
    try:
        path = tmp_path / "new" / "deeper" / "trace.jsonl"
        TraceLog(path, tokenizer="bytes").close()
    finally:
        os.umask(old)
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700


def test_an_existing_world_readable_trace_is_kept_and_warned_about(tmp_path, caplog):
    path = tmp_path / "trace.jsonl"
    path.write_text("")
    path.chmod(0o644)
    TraceLog(path).close()
    assert _mode(path) == 0o644 and "chmod 600" in caplog.text


def test_keys_only_cannot_include_text(tmp_path):
    with pytest.raises(ValueError, match="keys-only"):
        TraceLog(tmp_path / "t.jsonl", include_text=True, keys_only=True)


def test_keys_only_trace_has_no_tokens_or_text_and_replays(serve, make_engine, tmp_path):
    path = tmp_path / "trace.jsonl"
    engine = make_engine()
    server = serve(engine, model_name=MODEL, api_keys=KEYS, trace_log=path, trace_keys_only=True)
    for key, question in (("sk-a", "first?"), ("sk-a", "second?"), ("sk-b", "first?")):
        assert _chat(server.url, key, question).status_code == 200
    raw = path.read_text()
    header, *lines = [json.loads(line) for line in raw.splitlines()]
    # The header: the engine's KV layout (dtype, bytes per token), no prompt content.
    assert header["type"] == "header" and set(header) == {
        "v",
        "type",
        "dtype",
        "kv_bytes_per_token",
        "block_size",
    }
    assert len(lines) == 3
    for line in lines:
        assert "tokens" not in line and "messages" not in line and "prompt" not in line
        assert line["block_size"] == 16
        assert len(line["block_keys"]) == line["prompt_tokens"] // 16
    assert "first?" not in raw and "shared system" not in raw
    a1, a2, b1 = (line["block_keys"] for line in lines)
    shared = (len(engine.tokenize(SYSTEM)) + 5) // 16  # the system turn's full blocks, at least
    assert shared >= 2 and a1[:shared] == a2[:shared]  # one tenant's shared prefix: equal keys
    assert not set(a1) & set(b1)  # another tenant's keys never equal (per-tenant salt)
    # The keys are not the cache's own (they name no entry of the cache or of a tier).
    ns = engine.cache.namespace(engine.fingerprint, tenant="alpha", salt=server.state.auth.salt_for("alpha"))
    cache_keys = {
        k.hex()
        for k in engine.cache.block_keys(
            engine.render_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first?"}]),
            ns,
        )
    }
    assert cache_keys and not cache_keys & set(a1)
    # The audit tools replay it: the same sharing structure as the tokens had.
    trace = load_trace(path)
    assert len(trace) == 3 and trace.tenant_name(2) == "beta"


def test_trace_keys_are_chained_per_salt():
    ids = list(range(40))
    assert trace_keys(ids, b"s", 16) == trace_keys(ids[:32] + [99] * 8, b"s", 16)  # 2 full blocks each
    assert trace_keys(ids, b"s", 16)[0] != trace_keys(ids, b"t", 16)[0]
    assert len(trace_keys(ids[:15], b"s", 16)) == 0
