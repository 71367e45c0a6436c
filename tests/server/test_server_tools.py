"""Tools on the chat and messages routes through the official SDKs against a live server: a
two-turn tool loop on each API that reads tools + system + history from the cache, calls
parsed from (scripted) replies whole and streamed, tool_choice, and the 400s."""

from __future__ import annotations

import anthropic
import openai
import pytest
from server_helpers import Scripted

from prefixcache.engine.tiny import EOS

MODEL = "test-model"
SYSTEM = "You are the weather desk of a small newspaper. Answer in one short sentence. " * 3
QUESTION = "What is the weather in Paris today, and should I take an umbrella?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "A city name"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the archive.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Current weather of a city.", "input_schema": WEATHER_SCHEMA},
    {
        "name": "search",
        "description": "Search the archive.",
        "input_schema": OPENAI_TOOLS[1]["function"]["parameters"],
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    },
]
CALL_REPLY = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def scripted(make_engine) -> Scripted:
    return Scripted(make_engine())


@pytest.fixture
def server(serve, scripted):
    return serve(scripted, model_name=MODEL)


@pytest.fixture
def oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def an(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def tools_and_system_tokens(prompt_ids: list[int]) -> int:
    """Tokens of the rendered tools + system prompt: the prompt up to the end of its first turn."""
    return prompt_ids.index(EOS) + 1


def assert_second_turn_read_the_first_from_the_cache(scripted: Scripted, cached: int) -> None:
    first, second = (r.prompt_token_ids for r in scripted.results[-2:])
    assert second[: len(first)] == first  # turn 1's prompt (tools, system, question) is turn 2's prefix
    assert cached == len(first) // 16 * 16  # every full block of it was read
    assert cached >= tools_and_system_tokens(first)


def test_openai_two_turn_tool_loop_reads_tools_system_and_history_from_the_cache(oa, scripted):
    scripted.reply = ""  # turn 1: the engine's real prompt, the reply does not matter
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt = scripted.requests[-1]["messages"][0]["content"]
    assert prompt.startswith("# Tools") and prompt.endswith(SYSTEM)  # tools first, then the system prompt
    # Turn 2: the model's call (built by hand: the tiny random model does not call tools) and its result.
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, light rain"},
    ]
    scripted.reply = "Light rain: take an umbrella."
    second = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=2, temperature=0
    )
    assert second.choices[0].message.content == "Light rain: take an umbrella."
    assert second.choices[0].finish_reason == "stop"
    assert_second_turn_read_the_first_from_the_cache(
        scripted, second.usage.prompt_tokens_details.cached_tokens
    )
    history = scripted.requests[-1]["messages"]
    assert (
        history[2]["content"]
        == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    assert history[3] == {
        "role": "user",
        "content": '<tool_response>{"name": "get_weather", "content": "18 C, light rain"}</tool_response>',
    }


def test_anthropic_two_turn_tool_loop_reads_tools_system_and_history_from_the_cache(an, scripted, server):
    scripted.reply = ""
    messages = [{"role": "user", "content": QUESTION}]
    first = an.messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=messages
    )
    assert first.usage.cache_read_input_tokens == 0
    messages += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, light rain"}],
        },
    ]
    scripted.reply = "Light rain: take an umbrella."
    second = an.messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=messages
    )
    assert second.content[0].text == "Light rain: take an umbrella." and second.stop_reason == "end_turn"
    assert_second_turn_read_the_first_from_the_cache(scripted, second.usage.cache_read_input_tokens)
    # The last tool's cache_control: the full blocks up to the end of the tools section (and
    # no further: the system prompt follows it) have the 1-hour TTL.
    text = scripted.tokenizer.decode(scripted.results[-1].prompt_token_ids)
    section_end = text.index("</tool_call>\n\n" + SYSTEM) + len("</tool_call>")
    tools_tokens = len(scripted.tokenize(text[:section_end]))
    assert sum(b.ttl_s == 3600.0 for b in server.engine.cache.store) == tools_tokens // 16 > 0


def test_the_same_tools_render_to_the_same_tokens_on_both_apis(oa, an, scripted):
    oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        tools=OPENAI_TOOLS,
        max_tokens=1,
    )
    an.messages.create(
        model=MODEL,
        max_tokens=1,
        system=SYSTEM,
        tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": QUESTION}],
    )
    a, b = (r.prompt_token_ids for r in scripted.results)
    assert a == b


def test_a_call_in_the_reply_becomes_tool_calls(oa, an, scripted):
    scripted.reply = CALL_REPLY
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=OPENAI_TOOLS, max_tokens=2
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    m = an.messages.create(
        model=MODEL, max_tokens=2, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": "x"}]
    )
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[1].id.startswith("toolu_") and m.content[1].input == {"city": "Paris"}


def test_streamed_calls_are_tool_call_deltas_and_tool_use_blocks(oa, an, scripted):
    scripted.reply = CALL_REPLY + "\n" + CALL_REPLY.split("\n")[1].replace("Paris", "Oslo")
    with oa.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=OPENAI_TOOLS, max_tokens=2
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me check."
    assert "<tool_call>" not in text
    message = final.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Oslo"}'),
    ]
    assert final.choices[0].finish_reason == "tool_calls"
    with an.messages.stream(
        model=MODEL, max_tokens=2, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        kinds = [e.type for e in stream]
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me check."
    assert [b.input for b in message.content[1:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert message.stop_reason == "tool_use"
    assert kinds.count("content_block_start") == 3 and kinds[-2:] == ["message_delta", "message_stop"]


def test_a_reply_that_only_looks_like_a_call_stays_text(oa, scripted):
    scripted.reply = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=OPENAI_TOOLS
    )
    assert r.choices[0].message.content == scripted.reply and r.choices[0].message.tool_calls is None
    chunks = list(
        oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=OPENAI_TOOLS, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == scripted.reply
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice(oa, an, scripted):
    user = [{"role": "user", "content": "x"}]
    scripted.reply = '{"name": "search", "arguments": {"q": "rain"}}</tool_call>'
    r = oa.chat.completions.create(model=MODEL, messages=user, tools=OPENAI_TOOLS, tool_choice="required")
    assert scripted.requests[-1]["prompt"].endswith(
        "<|im_start|>assistant\n<tool_call>"
    )  # the reply is forced open
    assert r.choices[0].message.tool_calls[0].function.name == "search"
    scripted.reply = '{"city": "Oslo"}}</tool_call>'
    r = oa.chat.completions.create(
        model=MODEL,
        messages=user,
        tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    m = an.messages.create(
        model=MODEL,
        max_tokens=2,
        tools=ANTHROPIC_TOOLS,
        messages=user,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert m.content[-1].input == {"city": "Oslo"} and m.stop_reason == "tool_use"
    scripted.reply = CALL_REPLY
    r = oa.chat.completions.create(model=MODEL, messages=user, tools=OPENAI_TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL_REPLY and r.choices[0].finish_reason == "stop"
    oa.chat.completions.create(model=MODEL, messages=user, tools=OPENAI_TOOLS, parallel_tool_calls=False)
    assert scripted.requests[-1]["stop"] == ["</tool_call>"]  # one call, then stop
    an.messages.create(
        model=MODEL,
        max_tokens=2,
        tools=ANTHROPIC_TOOLS,
        messages=user,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
    )
    assert scripted.requests[-1]["stop"] == ["END", "</tool_call>"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [OPENAI_TOOLS[0], OPENAI_TOOLS[0]]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        (
            {"messages": [{"role": "tool", "tool_call_id": "call_9", "content": "r"}]},
            "messages[0].tool_call_id",
        ),
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "a", "arguments": "{}"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_openai_tool_refusals_name_the_field(oa, kwargs, param):
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(**args)
    assert info.value.body["param"] == param
    assert param in info.value.body["message"]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": {}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_anthropic_tool_refusals_name_the_field(an, kwargs, needle):
    args = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.create(**args)
    assert info.value.body["type"] == "error"
    assert needle in info.value.body["error"]["message"]


def test_count_tokens_counts_the_tools(an, scripted):
    plain = an.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": QUESTION}])
    with_tools = an.messages.count_tokens(
        model=MODEL, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": QUESTION}]
    )
    scripted.reply = ""
    m = an.messages.create(
        model=MODEL, max_tokens=1, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": QUESTION}]
    )
    u = m.usage
    assert (
        with_tools.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    )
    assert with_tools.input_tokens > plain.input_tokens


# ------------------------------------------------------------ tools with n, logprobs, message_start

OSLO_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_n_choices_each_parse_their_own_calls_whole_and_streamed(oa, scripted):
    scripted.reply = [CALL_REPLY, "Sunny all day.", OSLO_CALL]
    user = [{"role": "user", "content": QUESTION}]
    r = oa.chat.completions.create(model=MODEL, messages=user, tools=OPENAI_TOOLS, n=3, max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "stop", "tool_calls"]
    assert [c.message.content for c in r.choices] == ["Let me check.", "Sunny all day.", None]
    calls = [[(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] for c in r.choices]
    expected = [[("get_weather", '{"city": "Paris"}')], [], [("get_weather", '{"city": "Oslo"}')]]
    assert calls == expected
    assert r.choices[0].message.tool_calls[0].id != r.choices[2].message.tool_calls[0].id
    assert r.usage.prompt_tokens == len(scripted.results[-1].prompt_token_ids)  # the prompt once

    chunks = list(
        oa.chat.completions.create(
            model=MODEL, messages=user, tools=OPENAI_TOOLS, n=3, max_tokens=2, stream=True
        )
    )
    text = {i: "" for i in range(3)}
    streamed: dict[int, dict[int, list[str]]] = {i: {} for i in range(3)}
    finish = {}
    for chunk in chunks:  # the deltas of the three choices arrive interleaved (Scripted)
        (c,) = chunk.choices
        text[c.index] += c.delta.content or ""
        for t in c.delta.tool_calls or []:
            entry = streamed[c.index].setdefault(t.index, ["", ""])
            entry[0] += t.function.name or ""
            entry[1] += t.function.arguments or ""
        if c.finish_reason:
            assert c.index not in finish
            finish[c.index] = c.finish_reason
    assert text == {0: "Let me check.", 1: "Sunny all day.", 2: ""}
    assert [[tuple(v) for v in streamed[i].values()] for i in range(3)] == expected
    assert finish == {0: "tool_calls", 1: "stop", 2: "tool_calls"}


def test_logprobs_with_parsed_tool_calls_is_a_400_naming_logprobs(oa, scripted):
    user = [{"role": "user", "content": QUESTION}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(
                model=MODEL, messages=user, tools=OPENAI_TOOLS, logprobs=True, stream=stream
            )
        assert info.value.body["param"] == "logprobs" and "'logprobs'" in info.value.body["message"]
    scripted.reply = None  # the model's own tokens: tool_choice none parses no calls, logprobs line up
    r = oa.chat.completions.create(
        model=MODEL,
        messages=user,
        tools=OPENAI_TOOLS,
        tool_choice="none",
        logprobs=True,
        top_logprobs=2,
        max_tokens=3,
        n=2,
    )
    assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for c in r.choices for t in c.logprobs.content)


def test_anthropic_stream_has_message_start_usage_and_tool_use_blocks(an, scripted):
    scripted.reply = CALL_REPLY
    fields = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    seen = []
    for _ in range(2):  # a miss that writes tools + system, then a hit that reads them
        with an.messages.stream(
            model=MODEL,
            max_tokens=2,
            system=SYSTEM,
            tools=ANTHROPIC_TOOLS,
            messages=[{"role": "user", "content": QUESTION}],
        ) as stream:
            events = list(stream)
            message = stream.get_final_message()
        assert events[0].type == "message_start"
        start = events[0].message.usage
        assert [getattr(start, f) for f in fields] == [getattr(message.usage, f) for f in fields]
        assert start.output_tokens == 0
        assert [b.type for b in message.content] == ["text", "tool_use"]
        assert message.content[0].text == "Let me check." and message.content[1].input == {"city": "Paris"}
        assert message.stop_reason == "tool_use"
        seen.append(start)
    assert seen[0].cache_creation_input_tokens > 0 and seen[0].cache_read_input_tokens == 0
    assert seen[1].cache_read_input_tokens == seen[0].cache_creation_input_tokens
