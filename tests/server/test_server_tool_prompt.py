"""Tools into the prompt without a server: the fallback convention, conversations from each
API's history, and a cache_control breakpoint on a tool result at its exact token position."""

from __future__ import annotations

import pytest

from prefixcache.server.anthropic.prompt import anthropic_tool_config, plan_for, to_messages
from prefixcache.server.anthropic.schemas import MessagesRequest
from prefixcache.server.errors import APIError
from prefixcache.server.openai.prompt import chat_conversation, responses_conversation
from prefixcache.server.openai.schemas import ChatMessage
from prefixcache.server.tools.prompt import FunctionTool, ToolCall, assistant_turn, flatten, tool_turn

WEATHER = FunctionTool(
    "get_weather", "Weather.", {"type": "object", "properties": {"city": {"type": "string"}}}
)


def test_without_tools_the_conversation_is_unchanged():
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert flatten(conv, ()) == conv


def test_the_tools_section_opens_the_system_message_and_results_share_a_user_turn():
    calls = [ToolCall("a", "get_weather", '{"city":"Paris"}'), ToolCall("b", "get_weather", "not json")]
    conv = [
        {"role": "user", "content": "Paris and Oslo?"},
        assistant_turn("", calls),
        tool_turn("a", "get_weather", "18 C"),
        tool_turn("b", "get_weather", "oops", is_error=True),
    ]
    flat = flatten(conv, (WEATHER,))
    assert [m["role"] for m in flat] == ["system", "user", "assistant", "user"]
    assert flat[0]["content"].startswith("# Tools\n\n")
    assert (
        '\n{"type": "function", "function": {"name": "get_weather", "description": "Weather.", '
        in flat[0]["content"]
    )
    assert flat[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": "not json"}</tool_call>'
    )
    assert flat[3]["content"] == (
        '<tool_response>{"name": "get_weather", "content": "18 C"}</tool_response>\n'
        '<tool_response>{"name": "get_weather", "content": "oops", "is_error": true}</tool_response>'
    )


def test_chat_history_maps_roles_and_checks_call_ids():
    msgs = [
        ChatMessage(role="developer", content="D"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            }
        ),
        ChatMessage(role="tool", tool_call_id="c1", content="r"),
    ]
    conv = chat_conversation(msgs)
    assert conv[0] == {"role": "system", "content": "D"}
    assert conv[2] == {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "r"}


def test_responses_items_join_function_calls_to_the_assistant_turn_before_them():
    call = {"type": "function_call", "name": "get_weather", "arguments": "{}"}
    conv = responses_conversation(
        "I",
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {**call, "call_id": "c1"},
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c2", "output": "r2"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "r1"}],
            },
            {**call, "call_id": "c3"},
        ],
    )
    assert [t["role"] for t in conv] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert conv[2]["content"] == "Checking." and [c["id"] for c in conv[2]["tool_calls"]] == ["c1", "c2"]
    assert (conv[4]["name"], conv[4]["content"]) == ("get_weather", "r1")
    assert conv[5] == assistant_turn("", [ToolCall("c3", "get_weather", "{}")])
    with pytest.raises(APIError, match=r"input\[0\]\.arguments"):
        responses_conversation(None, [{"type": "function_call", "call_id": "c", "name": "x"}])


def test_a_breakpoint_on_a_tool_result_ends_where_the_result_ends(make_engine):
    engine = make_engine()  # byte tokenizer: positions are easy to state
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "system": "Be brief.",
            "tools": [
                {
                    "name": "get_weather",
                    "input_schema": {"type": "object"},
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                }
            ],
            "messages": [
                {"role": "user", "content": "Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": "18 C",
                            "cache_control": {"type": "ephemeral"},
                        },
                        {"type": "text", "text": "And now?"},
                    ],
                },
            ],
        }
    )
    conv, bps = to_messages(req)
    renderer = engine_renderer(engine, anthropic_tool_config(req))
    rendered = renderer.render(conv)
    full = engine.render_ids(rendered.messages)
    plan = plan_for(conv, bps, full, renderer, engine.tokenize)
    text = engine.render(rendered.messages)

    def upto(marker: str, keep: int | None = None) -> int:
        """Tokens up to the end of ``marker`` (or of its first ``keep`` characters)."""
        end = text.index(marker) + (len(marker) if keep is None else keep)
        return len(engine.tokenize(text[:end]))

    # The tool's breakpoint ends with the tools section (the system prompt follows it); the
    # result's, with the result's user turn, closing tag included (the next turn follows it).
    tools_end = upto("</tool_call>\n\nBe brief.", keep=len("</tool_call>"))
    result_end = upto('"content": "18 C"}</tool_response><|im_end|>\n')
    assert plan == [(tools_end, 3600.0), (result_end, 300.0)]


def engine_renderer(engine, config):
    from prefixcache.server.tools.prompt import PromptRenderer

    return PromptRenderer(
        config, engine.tokenizer, lambda m, gen: engine.render(m, add_generation_prompt=gen)
    )
