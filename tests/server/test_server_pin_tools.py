"""POST /v1/cache/pin with tools: an agent's tool definitions and system prompt kept warm."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from prefixcache.engine.engine import Engine

MODEL = "tiny"
SYSTEM = {"role": "system", "content": "You are a weather agent. Call a tool when the user asks for weather."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city, in degrees Celsius.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "The forecast for the next days in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
]


def _pin_then_ask(url: str, engine: Any) -> tuple[int, Any, Any]:
    r = httpx.post(url + "/v1/cache/pin", json={"messages": [SYSTEM], "tools": TOOLS}, timeout=120)
    assert r.status_code == 200, r.text
    pinned = r.json()["pinned_tokens"]
    assert pinned >= 64 and engine.cache.stats().pinned_blocks == pinned // 16
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    user = {"role": "user", "content": "What is the weather in Lyon?"}
    with_tools = client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, user], tools=TOOLS, max_tokens=3, temperature=0
    )
    without = client.chat.completions.create(
        model=MODEL, messages=[SYSTEM, user], max_tokens=3, temperature=0
    )
    return pinned, with_tools, without


def test_a_pinned_tools_prefix_is_hit_by_a_chat_request_with_those_tools(
    serve: Any, make_engine: Any
) -> None:
    engine = make_engine()
    server = serve(engine, model_name=MODEL)
    pinned, with_tools, without = _pin_then_ask(server.url, engine)
    assert with_tools.usage.prompt_tokens_details.cached_tokens >= pinned  # every pinned block read
    # The tools are part of the pinned prefix: the same chat without them shares less of it.
    assert without.usage.prompt_tokens_details.cached_tokens < pinned
    unpin = httpx.request("DELETE", server.url + "/v1/cache/pin", json={"messages": [SYSTEM], "tools": TOOLS})
    assert unpin.json()["unpinned_tokens"] == pinned and engine.cache.stats().pinned_blocks == 0


def test_tools_without_messages_or_of_another_type_are_400(serve: Any, make_engine: Any) -> None:
    server = serve(make_engine(), model_name=MODEL)
    r = httpx.post(server.url + "/v1/cache/pin", json={"prompt": "hello", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    bad = [{"type": "web_search"}]
    r = httpx.post(server.url + "/v1/cache/pin", json={"messages": [SYSTEM], "tools": bad}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type"


@pytest.mark.model
def test_real_model_pinned_tools_prefix_is_hit(serve: Any, real_runner: Any) -> None:
    engine = Engine(real_runner)
    try:
        server = serve(engine, model_name=MODEL)
        pinned, with_tools, without = _pin_then_ask(server.url, engine)
        assert with_tools.usage.prompt_tokens_details.cached_tokens >= pinned
        assert without.usage.prompt_tokens_details.cached_tokens < pinned
    finally:
        engine.close()
