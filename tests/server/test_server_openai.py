"""The OpenAI routes driven by the official ``openai`` SDK against a live uvicorn server."""

from __future__ import annotations

import openai
import pytest

MODEL = "test-model"
SYSTEM = "You are a careful assistant for the prefixcache project. " * 12


@pytest.fixture
def server(serve, make_engine):
    return serve(make_engine(), model_name=MODEL)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, user: str, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=kw.pop("max_tokens", 4),
        temperature=0,
        **kw,
    )


def test_chat_reports_cached_tokens_on_the_second_request(client):
    first = chat(client, "What is a block?")
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert isinstance(first.choices[0].message.content, str)
    assert first.choices[0].finish_reason in ("stop", "length")
    u1 = first.usage
    assert u1.prompt_tokens_details.cached_tokens == 0
    assert u1.prompt_tokens_details.cache_write_tokens > 0
    assert u1.total_tokens == u1.prompt_tokens + u1.completion_tokens
    second = chat(client, "And what is a TTL?")
    u2 = second.usage
    # The shared system prompt's blocks were written by the first request and read by the second.
    assert u2.prompt_tokens_details.cached_tokens > len(SYSTEM) // 2
    assert u2.prompt_tokens_details.cached_tokens <= u1.prompt_tokens_details.cache_write_tokens


def test_chat_stream_with_usage(client):
    chat(client, "warm up")
    chunks = list(
        chat(client, "stream this", stream=True, stream_options={"include_usage": True}, max_tokens=5)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(client, "stream this", max_tokens=5).choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 5 or finals[0].choices[0].finish_reason == "stop"
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_without_usage(client):
    chunks = list(chat(client, "no usage", stream=True, max_tokens=3))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_completions_plain_and_stream(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 3
    r2 = client.completions.create(model=MODEL, prompt=prompt + "Again?", max_tokens=3, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "obj"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "raw chunks"}]},
            "chat.completion.chunk",
        ),
        ("/v1/completions", {"prompt": "raw chunks of a completion"}, "text_completion"),
    ],
)
def test_stream_chunks_in_order_with_and_without_usage(server, path, body, obj):
    """Both routes' chunks, as bytes on the wire: the same head in the same key order, ``usage``
    null in every chunk and one last choice-less chunk with the usage when asked, none otherwise."""
    import json

    import httpx

    def chunks(extra):
        req = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True, **body, **extra}
        with httpx.stream("POST", server.url + path, json=req, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    head = ["id", "object", "created", "model", "system_fingerprint", "choices"]
    plain = chunks({})
    assert all(list(c) == head and c["object"] == obj and len(c["choices"]) == 1 for c in plain)
    with_usage = chunks({"stream_options": {"include_usage": True}})
    assert all(list(c) == [*head, "usage"] and c["usage"] is None for c in with_usage[:-1])
    last = with_usage[-1]
    assert list(last)[:7] == [*head, "usage"] and set(list(last)[7:]) <= {"prefixcache"}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 3
    assert last["usage"]["prompt_tokens_details"]["cache_write_tokens"] >= 0
    assert [c["choices"] for c in with_usage[:-1]] == [c["choices"] for c in plain]


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_prompt_cache_retention_24h_sets_the_long_class(server, client):
    chat(client, "long lived", extra_body={"prompt_cache_retention": "24h", "prompt_cache_key": "docs-bot"})
    ttls = {b.ttl_s for b in server.engine.cache.store}
    assert ttls == {86400.0}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": "nope"}, "Unknown model"),
        ({"messages": []}, "messages"),
        ({"temperature": 5}, "temperature"),
        ({"n": 17}, "'n'"),  # above --max-batch (16)
        ({"n": 0}, "'n'"),
        ({"top_logprobs": 2}, "'top_logprobs'"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs'"),
        ({"extra_body": {"prompt_cache_retention": "1w"}}, "prompt_cache_retention"),
    ],
)
def test_bad_requests_are_4xx_with_a_message(client, kwargs, needle):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**args)
    assert 400 <= info.value.status_code < 500
    body = info.value.body
    assert needle in body["message"]
    assert set(body) >= {"message", "type", "param", "code"}


def test_context_overflow_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    assert "context" in info.value.body["message"]
