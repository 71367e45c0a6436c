"""Miss reasons through the live server (tiny model, byte tokenizer: token index = byte offset):
each reason provoked on purpose and reported with the planted token index, in the ``prefixcache``
object of every route, in /metrics and in the trace log; Anthropic's ``diagnostics`` parsed by
the official SDK."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from prefixcache.cache import FakeClock

MODEL = "test-model"
SYSTEM = (
    "You answer questions about exact prefix caching. Blocks are sixteen tokens long, keys are "
    "chained hashes, and a hit must give the same logits as recomputing. Keep every answer short."
)
#: "<|im_start|>system\n" is 8 tokens of the byte tokenizer: system character p is token 8 + p.
SYSTEM_AT = 8
TEMPLATE = 29  # the chat template's tokens around one system and one user message
TTL = 300.0


def prompt_len(system: str, user: str) -> int:
    return len(system.encode()) + len(user.encode()) + TEMPLATE


def readable(tokens: int) -> int:
    """Tokens a request may read: full blocks, the last prompt token always computed."""
    return (tokens - 1) // 16 * 16


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def chat(client: openai.OpenAI, system: str, user: str = "What is a block?", **kw):
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        **kw,
    )
    return r, r.model_extra["prefixcache"]


def metric(server, name: str, reason: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    line = f'{name}{{reason="{reason}"}} '
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def test_every_reason_on_purpose(serve, make_engine, clock, tmp_path):
    trace = tmp_path / "trace.jsonl"
    server = serve(make_engine(clock=clock, default_ttl_s=TTL), model_name=MODEL, trace_log=trace)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    n = prompt_len(SYSTEM, "What is a block?")

    r, pc = chat(client, SYSTEM)
    assert pc == {"reason": "new_prefix", "cached_tokens": 0, "cache_missed_tokens": 0}

    r, pc = chat(client, SYSTEM)
    assert r.usage.prompt_tokens_details.cached_tokens == readable(n)
    assert pc == {"reason": "full_hit", "cached_tokens": readable(n), "cache_missed_tokens": 0}

    # A system prompt edited at character 100: the prompt leaves the cached one at token 108.
    edited = SYSTEM[:100] + "X" + SYSTEM[101:]
    r, pc = chat(client, edited)
    assert pc["reason"] == "diverged"
    assert pc["divergence"]["token_index"] == SYSTEM_AT + 100
    assert pc["cached_tokens"] == 96  # blocks 0..5 hold tokens 0..95, all before the edit
    assert pc["cache_missed_tokens"] == readable(n) - 96
    assert pc["divergence"]["text_before"] == SYSTEM[92:100]
    assert pc["divergence"]["prompt_text"] == edited[100:108]
    assert pc["divergence"]["cached_text"] == SYSTEM[100:108]

    # A timestamp at the top of the system prompt: the seconds' digit is character 13.
    r, pc = chat(client, "Time: 07:00:01. " + SYSTEM)  # leaves every cached prompt at its first character
    assert (pc["reason"], pc["divergence"]["token_index"], pc["cached_tokens"]) == ("diverged", SYSTEM_AT, 0)
    r, pc = chat(client, "Time: 07:00:02. " + SYSTEM)
    assert (pc["reason"], pc["divergence"]["token_index"]) == ("diverged", SYSTEM_AT + 13)
    assert pc["cached_tokens"] == 16 and pc["cache_missed_tokens"] == readable(n + 16) - 16

    # Past the TTL every block is gone: expired, 100 s after the blocks' expiry.
    clock.advance(TTL + 100)
    r, pc = chat(client, edited)
    assert pc == {
        "reason": "expired",
        "cached_tokens": 0,
        "cache_missed_tokens": readable(n),
        "expired_ago_s": 100.0,
    }

    # The tenant flushes its cache; the next request says so.
    assert httpx.delete(server.url + "/v1/cache").status_code == 200
    clock.advance(7)
    r, pc = chat(client, edited)
    assert pc == {
        "reason": "flushed",
        "cached_tokens": 0,
        "cache_missed_tokens": readable(n),
        "removed_ago_s": 7.0,
    }

    # Shorter than one block: nothing could be read.
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert c.model_extra["prefixcache"]["reason"] == "below_minimum"

    assert metric(server, "prefixcache_cache_missed_tokens_total", "expired") == readable(n)
    assert metric(server, "prefixcache_cache_missed_tokens_total", "flushed") == readable(n)
    assert metric(server, "prefixcache_cache_read_reasons_total", "diverged") == 3
    assert metric(server, "prefixcache_cache_read_reasons_total", "new_prefix") == 1

    lines = [json.loads(line) for line in trace.read_text().splitlines() if '"tokens"' in line]
    assert [line["cache_reason"] for line in lines] == [
        "new_prefix",
        "full_hit",
        "diverged",
        "diverged",
        "diverged",
        "expired",
        "flushed",
        "below_minimum",
    ]
    assert lines[2]["divergence_token"] == SYSTEM_AT + 100
    assert lines[5]["cache_missed_tokens"] == readable(n)


def test_evicted_under_a_small_budget(serve, make_engine, clock):
    probe = make_engine(clock=clock)
    block = probe.runner.block_nbytes(16)
    reasons = 1 << 16
    engine = make_engine(clock=clock, capacity_bytes=10 * block + reasons, reasons_bytes=reasons)
    server = serve(engine, model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    a = "A" * 100  # prompts of 153 tokens: 9 full blocks, all readable
    b = "B" * 100
    chat(client, a)
    clock.advance(5)
    chat(client, b)  # B's 9 blocks need room: A keeps 1
    clock.advance(3)
    r, pc = chat(client, a)
    assert pc == {"reason": "evicted", "cached_tokens": 16, "cache_missed_tokens": 128, "removed_ago_s": 3.0}


def test_streams_and_responses_carry_the_object(serve, make_engine, clock):
    server = serve(make_engine(clock=clock), model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat(client, SYSTEM)
    stream = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    final = chunks[-1]
    assert final.usage is not None and final.model_extra["prefixcache"]["reason"] == "full_hit"
    assert all("prefixcache" not in (c.model_extra or {}) for c in chunks[:-1])
    resp = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="Another question?", max_output_tokens=2
    )
    pc = resp.model_extra["prefixcache"]
    # Another question after the same system prompt leaves the cached prompt where the user turn starts.
    assert (pc["reason"], pc["divergence"]["token_index"]) == ("diverged", SYSTEM_AT + len(SYSTEM) + 8)
    assert resp.model_extra["prefixcache"]["cached_tokens"] == resp.usage.input_tokens_details.cached_tokens


def ask(client: anthropic.Anthropic, system: str, messages: list[dict], previous: str | None, **kw):
    return client.messages.create(
        model=MODEL,
        max_tokens=2,
        system=system,
        messages=messages,
        diagnostics={"previous_message_id": previous},
        **kw,
    )


def test_anthropic_diagnostics_parsed_by_the_sdk(serve, make_engine, clock):
    server = serve(make_engine(clock=clock), model_name=MODEL)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    turn1 = [{"role": "user", "content": "What is a block?"}]
    first = ask(client, SYSTEM, turn1, None)
    assert first.diagnostics is None
    assert first.model_extra["prefixcache"]["reason"] == "new_prefix"

    turn2 = turn1 + [
        {"role": "assistant", "content": "A run of tokens."},
        {"role": "user", "content": "Why?"},
    ]
    second = ask(client, SYSTEM, turn2, first.id)
    assert second.diagnostics is None  # an appended turn changes nothing before it
    assert second.usage.cache_read_input_tokens > 0

    edited = SYSTEM[:100] + "X" + SYSTEM[101:]
    third = ask(client, edited, turn2, second.id)
    reason = third.diagnostics.cache_miss_reason
    assert reason.type == "system_changed"
    previous_tokens = second.usage.input_tokens + second.usage.cache_read_input_tokens
    previous_tokens += second.usage.cache_creation_input_tokens
    assert reason.cache_missed_input_tokens == readable(previous_tokens) - third.usage.cache_read_input_tokens
    assert third.model_extra["prefixcache"]["divergence"]["token_index"] == SYSTEM_AT + 100

    changed_turn = [{"role": "user", "content": "What is a key?"}] + turn2[1:]
    fourth = ask(client, edited, changed_turn, third.id)
    assert fourth.diagnostics.cache_miss_reason.type == "messages_changed"

    tool = {"name": "lookup", "description": "Look a word up.", "input_schema": {"type": "object"}}
    fifth = ask(client, edited, changed_turn, fourth.id, tools=[tool])
    assert fifth.diagnostics.cache_miss_reason.type == "tools_changed"

    # Same model, system, tools and messages, another tool_choice: no structural answer.
    sixth = ask(client, edited, changed_turn, fifth.id, tools=[tool], tool_choice={"type": "any"})
    assert sixth.diagnostics.cache_miss_reason.type == "unavailable"

    lost = ask(client, edited, changed_turn, "msg_never_sent")
    assert lost.diagnostics.cache_miss_reason.type == "previous_message_not_found"

    plain = client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=turn1)
    assert plain.diagnostics is None and "diagnostics" not in (plain.model_extra or {})

    # The beta surface and a stream: diagnostics arrive with message_start.
    beta = client.beta.messages.create(
        model=MODEL,
        max_tokens=2,
        system=SYSTEM,
        messages=turn1,
        diagnostics={"previous_message_id": fifth.id},
        betas=["cache-diagnosis-2026-04-07"],
    )
    assert beta.diagnostics.cache_miss_reason.type == "system_changed"
    with client.messages.stream(
        model=MODEL,
        max_tokens=2,
        system=edited,
        messages=turn1,
        diagnostics={"previous_message_id": beta.id},
    ) as stream:
        final = stream.get_final_message()
    assert final.diagnostics.cache_miss_reason.type == "system_changed"
    # Structurally the system changed since the previous answer, but this exact prompt is a prefix
    # of the third request's, which is cached: our own object says so.
    assert final.model_extra["prefixcache"]["reason"] == "full_hit"


def test_diagnostics_and_reasons_stay_within_the_tenant(serve, make_engine, clock):
    keys = {"sk-alpha": "alpha", "sk-beta": "beta", "sk-gamma": "gamma"}
    server = serve(make_engine(clock=clock), model_name=MODEL, api_keys=keys, salt_secret="s")
    alpha, beta, gamma = (
        anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) for key in keys
    )
    turn = [{"role": "user", "content": "What is a block?"}]
    edited = SYSTEM[:50] + "X" + SYSTEM[51:]
    mine = ask(alpha, SYSTEM, turn, None)
    # Alpha's cached prompt is the nearest to this one (it leaves it at token 11), but beta is
    # told only of its own cache, and alpha's answer ids are not beta's.
    near = ask(beta, SYSTEM[:3] + "X" + SYSTEM[4:], turn, mine.id)
    assert near.diagnostics.cache_miss_reason.type == "previous_message_not_found"
    assert near.model_extra["prefixcache"] == {
        "reason": "new_prefix",
        "cached_tokens": 0,
        "cache_missed_tokens": 0,
    }
    own = ask(alpha, edited, turn, mine.id)
    assert own.diagnostics.cache_miss_reason.type == "system_changed"
    assert own.model_extra["prefixcache"]["divergence"]["token_index"] == SYSTEM_AT + 50
    # Alpha's blocks expire: gamma, sending alpha's prompt, never cached it.
    clock.advance(TTL + 1)
    late = ask(gamma, SYSTEM, turn, None)
    assert late.model_extra["prefixcache"]["reason"] == "new_prefix"
    assert ask(alpha, SYSTEM, turn, None).model_extra["prefixcache"]["reason"] == "expired"


def test_bad_diagnostics_are_a_400_that_names_the_field(serve, make_engine, clock):
    server = serve(make_engine(clock=clock), model_name=MODEL)
    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for bad in ({"previous_message_id": 123}, "msg_1", {"previous_message_id": "m" * 201}):
        r = httpx.post(server.url + "/v1/messages", json={**base, "diagnostics": bad})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "diagnostics" in body["error"]["message"]
