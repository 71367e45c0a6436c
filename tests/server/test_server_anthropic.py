"""The Anthropic routes driven by the official ``anthropic`` SDK against a live uvicorn server."""

from __future__ import annotations

import anthropic
import pytest

from prefixcache.cache import FakeClock

MODEL = "test-model"
SYSTEM = "You answer questions about exact prefix caching, briefly and precisely. " * 10


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def server(serve, make_engine, clock):
    return serve(make_engine(clock=clock), model_name=MODEL)


@pytest.fixture
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def ask(client: anthropic.Anthropic, user: str, system=SYSTEM, **kw):
    return client.messages.create(
        model=MODEL,
        max_tokens=kw.pop("max_tokens", 4),
        system=system,
        messages=[{"role": "user", "content": user}],
        **kw,
    )


def test_usage_fields_and_a_second_request_reads_the_cache(client):
    first = ask(client, "What is a block?")
    assert first.type == "message" and first.role == "assistant"
    assert first.content[0].type == "text" and isinstance(first.content[0].text, str)
    u1 = first.usage
    assert u1.cache_read_input_tokens == 0
    assert u1.cache_creation_input_tokens > 0
    second = ask(client, "And a TTL?")
    u2 = second.usage
    assert u2.cache_read_input_tokens > 0
    # Hosted semantics: input_tokens is the part neither read from nor written to the cache.
    count = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "And a TTL?"}]
    )
    assert u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens == count.input_tokens


def test_stream_events_and_final_usage(client):
    ask(client, "warm")
    with client.messages.stream(
        model=MODEL,
        max_tokens=5,
        extra_body={"temperature": 0},
        system=SYSTEM,
        messages=[{"role": "user", "content": "stream it"}],
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert "content_block_start" in kinds and "content_block_delta" in kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert (
        message.content[0].text
        == ask(client, "stream it", max_tokens=5, extra_body={"temperature": 0}).content[0].text
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    assert message.usage.cache_read_input_tokens > 0


def test_one_hour_breakpoint_outlives_the_five_minute_default(client, clock):
    long_system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    short_system = "A different, default-TTL system prompt about something else entirely. " * 10
    first = ask(client, "q1", system=long_system)
    ask(client, "q1", system=short_system)
    created = first.usage.cache_creation
    assert 0 < created.ephemeral_1h_input_tokens <= first.usage.cache_creation_input_tokens
    assert (
        created.ephemeral_1h_input_tokens + created.ephemeral_5m_input_tokens
        == first.usage.cache_creation_input_tokens
    )
    clock.advance(600)  # past 5 minutes, within the hour
    long_again = ask(client, "q2", system=long_system)
    short_again = ask(client, "q2", system=short_system)
    assert long_again.usage.cache_read_input_tokens >= len(SYSTEM) - 16
    assert short_again.usage.cache_read_input_tokens == 0


def test_five_breakpoints_are_refused(client):
    cc = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"part {i}. ", "cache_control": cc} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(client, "hi", system=system)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "at most 4" in info.value.body["error"]["message"]


def test_unknown_ttl_names_the_allowed_values(client):
    system = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(client, "hi", system=system)
    message = info.value.body["error"]["message"]
    assert "'5m'" in message and "'1h'" in message


@pytest.mark.parametrize(
    ("kwargs", "status", "needle"),
    [
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "nope"}, 404, "Unknown model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ],
)
def test_bad_requests_are_4xx_in_anthropic_shape(client, kwargs, status, needle):
    args = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    args.update(kwargs)
    with pytest.raises(anthropic.APIStatusError) as info:
        client.messages.create(**args)
    assert info.value.status_code == status
    assert info.value.body["type"] == "error"
    assert needle in info.value.body["error"]["message"]
