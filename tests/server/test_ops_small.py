"""The smaller ops items: a pin of less than one block is a 400 that says so (nothing silently
pinned), a pin's prefill is no endpoint of the trace log, and a prompt over the context is
OpenAI's ``context_length_exceeded``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "test-model"
SYSTEM = "You keep answers short and exact; blocks are sixteen tokens. " * 4


def test_pin_of_less_than_a_block_is_refused_and_pins_are_not_traced(serve, make_engine, tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    server = serve(make_engine(), model_name=MODEL, trace_log=trace)
    r = httpx.post(server.url + "/v1/cache/pin", json={"prompt": "hello"}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "prefix_too_short" and err["param"] == "prompt"
    assert "5 tokens, shorter than one cache block (16 tokens)" in err["message"]

    ok = httpx.post(server.url + "/v1/cache/pin", json={"prompt": SYSTEM}, timeout=60)
    assert ok.status_code == 200 and ok.json()["pinned_tokens"] == len(SYSTEM) // 16 * 16
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model=MODEL, prompt=SYSTEM + "Q?", max_tokens=1)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    endpoints = [line["endpoint"] for line in lines if line.get("type") != "header"]
    assert endpoints == ["/v1/completions"]  # the pin's prefill is no endpoint's traffic


def test_a_prompt_over_the_context_is_context_length_exceeded(serve, make_engine) -> None:
    engine = make_engine()
    server = serve(engine, model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="a" * (engine.context_len + 50), max_tokens=1)
    assert caught.value.code == "context_length_exceeded"
    assert "context" in caught.value.body["message"]
