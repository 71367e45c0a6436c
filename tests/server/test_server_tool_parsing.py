"""The tool-call parser and its streaming form on crafted replies (no server, no model)."""

from __future__ import annotations

import json

import pytest

from prefixcache.server.tools.calls import ParsedCall, ToolCallSplitter, parse_tool_calls
from prefixcache.server.tools.prompt import CallSyntax

NAMES = {"get_weather", "search"}
WEATHER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')


def parse(reply: str, syntax: CallSyntax = CallSyntax.TAGGED):
    return parse_tool_calls(reply, NAMES, syntax)


def test_a_well_formed_call_alone():
    out = parse(WEATHER)
    assert out.text == ""
    assert out.calls == [PARIS]


def test_text_around_a_call_stays_text_and_separating_whitespace_goes():
    out = parse("Let me look.\n" + WEATHER + "\n\nDone.")
    assert out.text == "Let me look.Done."
    assert out.calls == [PARIS]


def test_several_calls_in_order():
    second = '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>'
    out = parse(WEATHER + "\n" + second)
    assert out.text == ""
    assert out.calls == [PARIS, ParsedCall("search", '{"q": "rain"}')]


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',  # malformed JSON
        '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_weather", "arguments": {}, "id": 3}</tool_call>',  # an unexpected key
        '<tool_call>{"name": "get_weather"} trailing</tool_call>',  # text after the object
        "<tool_call>",  # a stray tag
        'I would call <tool_call> if I could. {"name": "get_weather"}',
        "plain text, nothing else\n\n",
    ],
)
def test_anything_not_a_well_formed_call_stays_text_unchanged(reply):
    out = parse(reply)
    assert out.text == reply
    assert out.calls == []


def test_a_bad_call_stays_text_next_to_a_good_one():
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    out = parse(bad + WEATHER)
    assert out.text == bad
    assert out.calls == [PARIS]


def test_lenient_forms_of_a_call():
    # "parameters" for "arguments", arguments as a JSON string, no arguments, spaces and
    # newlines inside the tags, and a closing tag a stop string cut off at the very end.
    assert parse('<tool_call>{"name": "search", "parameters": {"q": "x"}}</tool_call>').calls == [
        ParsedCall("search", '{"q": "x"}')
    ]
    assert parse('<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>').calls == [
        ParsedCall("search", '{"q": "x"}')
    ]
    assert parse('<tool_call>\n{"name": "search"}\n</tool_call>').calls == [ParsedCall("search", "{}")]
    assert parse('<tool_call>{"name": "search", "arguments": {}}').calls == [ParsedCall("search", "{}")]


def test_an_unclosed_call_before_more_text_is_text():
    reply = '<tool_call>{"name": "search", "arguments": {}} and then more'
    assert parse(reply).text == reply


def test_json_syntax_takes_only_a_whole_json_reply():
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse(call, CallSyntax.JSON).calls == [PARIS]
    assert parse(f" [{call}, {call}] ", CallSyntax.JSON).calls == [PARIS, PARIS]
    assert parse("Sure: " + call, CallSyntax.JSON).calls == []
    assert (
        parse('{"name": "nope", "arguments": {}}', CallSyntax.JSON).text
        == '{"name": "nope", "arguments": {}}'
    )


def test_arguments_are_written_by_one_json_writer():
    out = parse('<tool_call>{"name":"search","arguments":{"q":"é","n":1}}</tool_call>')
    assert out.calls[0].arguments == '{"q": "é", "n": 1}'  # key order kept, fixed separators
    assert json.loads(out.calls[0].arguments) == {"q": "é", "n": 1}


REPLIES = [
    WEATHER,
    "Checking.\n" + WEATHER + "\n" + WEATHER,
    "No calls here, < and <tool at the end <tool_c",
    "Hm <tool_call>{broken}</tool_call> then " + WEATHER + " bye",
    "text   \n\n  ",
    "a <tool_call",
    "",
]


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streaming_gives_the_same_text_and_calls(reply, step):
    splitter = ToolCallSplitter(NAMES)
    sent = "".join(splitter.push(reply[i : i + step]) for i in range(0, len(reply), step))
    out = splitter.finish()
    assert sent == reply[: splitter.sent]
    assert sent + out.text[splitter.sent :] == parse(reply).text
    assert out.calls == parse(reply).calls


def test_streaming_holds_text_from_the_opening_tag_on():
    splitter = ToolCallSplitter(NAMES)
    assert splitter.push("Let me look. <tool") == "Let me look."
    assert splitter.push("_call>{") == ""
    assert splitter.push('"name": "get_weather"}</tool_call>') == ""
    assert splitter.finish().calls == [ParsedCall("get_weather", "{}")]


def test_a_forced_prefix_counts_as_reply_text():
    prefix = '<tool_call>{"name": "search", "arguments": '
    splitter = ToolCallSplitter(NAMES, prefix=prefix)
    assert splitter.push('{"q": "x"}}') == ""
    assert splitter.push("</tool_call>") == ""
    out = splitter.finish()
    assert out.calls == [ParsedCall("search", '{"q": "x"}')] and out.text == ""
