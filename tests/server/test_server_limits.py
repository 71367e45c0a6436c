"""Bounded requests (issue 11, item 3): a body over the limit is a 413 before it is parsed;
text that cannot fit the context is refused before it is tokenized (count_tokens and pins too);
seeds outside torch's range, lone surrogates and deep nesting are 400s that name the problem; a
temperature that would overflow the logits samples greedily."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

MODEL = "test-model"
HEAD = b'{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":'
CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


class CountingTokenizer:
    """The engine's tokenizer, counting the characters it was asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded_chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded_chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture
def counted(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, CountingTokenizer]]:
    engine = make_engine()
    tokenizer = CountingTokenizer(engine.runner.tokenizer)
    monkeypatch.setattr(engine.runner, "tokenizer", tokenizer)
    yield engine, tokenizer


def _post(url: str, raw: bytes, **kw: Any) -> httpx.Response:
    return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=60, **kw)


def test_a_60_mb_message_is_413_at_once_without_tokenizing(serve, counted):
    engine, tokenizer = counted
    server = serve(engine, model_name=MODEL)
    huge = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 60_000_000}]}).encode()
    for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        start = time.monotonic()
        r = _post(server.url + path, huge)
        took = time.monotonic() - start
        assert r.status_code == 413, r.text[:300]
        body = r.json()
        if shape == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
            message = body["error"]["message"]
        else:
            assert body["error"]["code"] == "request_too_large"
            message = body["error"]["message"]
        assert "--max-body-bytes" in message and str(8 << 20) in message
        assert took < 10  # the transfer only; tokenizing 60 MB took 66 s before
    assert tokenizer.encoded_chars == 0 and engine.prefilled_tokens == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'route="/v1/messages",status="413"' in metrics


def test_the_body_limit_is_configurable_and_counts_a_chunked_body(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL, max_body_bytes=2000)
    fits = json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 1500}]}).encode()
    assert len(fits) <= 2000 and _post(server.url + "/v1/chat/completions", fits).status_code == 200
    over = json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 2100}]}).encode()
    assert _post(server.url + "/v1/chat/completions", over).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(over), 500):
            yield over[i : i + 500]

    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
    # The server still answers on a new connection.
    assert _post(server.url + "/v1/chat/completions", fits).status_code == 200


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(serve, counted):
    engine, tokenizer = counted
    server = serve(engine, model_name=MODEL)
    text = "z" * (engine.max_prompt_bytes + 1)  # under the body limit, over context x 12 bytes
    requests = [
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}),
        ("/v1/responses", {"model": MODEL, "input": text}),
        ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": text}]}),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
        ("/v1/cache/pin", {"prompt": text}),
        ("/v1/cache/pin", {"messages": [{"role": "system", "content": text}]}),
    ]
    for path, body in requests:
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text[:300])
        assert "context" in r.text, (path, r.text[:300])
    assert tokenizer.encoded_chars == 0 and engine.prefilled_tokens == 0


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (
            b'{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":"\\ud800"}]}',
            "messages[0].content",
        ),
        (
            b'{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":"ok\\udfff"}]}',
            "messages[0].content",
        ),
        (
            b'{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}],"user":"\xed\xa0\x80"}',
            "user",
        ),
        (
            b'{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":[{"type":"text",'
            b'"text":"a\\ud83d"}]}]}',
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(serve, make_engine, raw, param):
    server = serve(make_engine(), model_name=MODEL)
    r = _post(server.url + "/v1/chat/completions", raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_unicode" and "surrogate" in err["message"]
    r = _post(server.url + "/v1/messages", raw.replace(b'"user":"\xed\xa0\x80"', b'"metadata":{"\\udc00":1}'))
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "surrogate" in r.json()["error"]["message"]


def test_valid_pairs_and_escaped_backslashes_are_text(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    for content in ('"\\ud83d\\ude00 an emoji"', '"code: \\\\ud800 is an escape"', '"nul \\u0000 inside"'):
        raw = HEAD + content.encode() + b"}]}"
        assert _post(server.url + "/v1/chat/completions", raw).status_code == 200, content


def test_deep_nesting_is_400(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    for depth in (65, 100_000):
        raw = HEAD + b'"x"}],"metadata":' + b"[" * depth + b"]" * depth + b"}"
        for path in ("/v1/chat/completions", "/v1/messages"):
            r = _post(server.url + path, raw)
            assert r.status_code == 400 and "levels deep" in r.text, (depth, path, r.text[:200])
    # Brackets inside strings are text, however many.
    text = json.dumps({**CHAT, "messages": [{"role": "user", "content": "[" * 1000}]})
    assert _post(server.url + "/v1/chat/completions", text.encode()).status_code == 200


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1, 10**40])
def test_a_seed_outside_torchs_range_is_400_naming_seed(serve, make_engine, seed):
    engine = make_engine()
    server = serve(engine, model_name=MODEL)
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "seed": seed}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed}),
    ):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert engine.prefilled_tokens == 0  # refused before the prefill


def test_seeds_at_the_edges_of_the_range_sample(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    for seed in (-1, -(1 << 63), (1 << 64) - 1):
        r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "seed": seed, "temperature": 1.0})
        assert r.status_code == 200, r.text


def test_a_temperature_that_overflows_the_logits_is_greedy(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    body = {**CHAT, "max_tokens": 6}
    greedy = httpx.post(server.url + "/v1/chat/completions", json={**body, "temperature": 0}).json()
    for t in (1e-40, 5e-324):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "temperature": t})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == greedy["choices"][0]["message"]
    r = httpx.post(server.url + "/v1/messages", json={**body, "temperature": 1e-40})
    assert r.status_code == 200, r.text
