"""POST /v1/responses through the official ``openai`` SDK against a live server."""

from __future__ import annotations

import openai
import pytest
from server_helpers import Scripted

MODEL = "test-model"
INSTRUCTIONS = "You are the support desk of a bicycle shop. Answer briefly and politely. " * 4
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture
def scripted(make_engine) -> Scripted:
    return Scripted(make_engine())


@pytest.fixture
def server(serve, scripted):
    return serve(scripted, model_name=MODEL)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_create_and_a_repeat_reads_the_cache(client, scripted):
    scripted.reply = "We open at nine."
    kw = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "max_output_tokens": 3,
        "temperature": 0,
        "prompt_cache_key": "desk",
        "prompt_cache_retention": "24h",
    }
    first = client.responses.create(input="When do you open on Saturdays?", **kw)
    assert first.object == "response" and first.status == "completed" and first.id.startswith("resp_")
    assert first.output_text == "We open at nine."
    assert first.output[0].type == "message" and first.output[0].content[0].type == "output_text"
    u1 = first.usage
    assert u1.input_tokens_details.cached_tokens == 0
    assert u1.input_tokens_details.cache_write_tokens == u1.input_tokens // 16 * 16
    assert u1.total_tokens == u1.input_tokens + u1.output_tokens
    assert (first.prompt_cache_key, first.store) == ("desk", False)
    second = client.responses.create(input="When do you open on Saturdays?", **kw)
    ids = scripted.results[-1].prompt_token_ids
    assert second.usage.input_tokens == len(ids)
    assert (
        second.usage.input_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
    )  # all but the last token
    assert {b.ttl_s for b in scripted.engine.cache.store} == {86400.0}  # prompt_cache_retention, as on chat
    # The same prompt through chat renders to the same tokens (and shares the cache).
    chat = client.chat.completions.create(
        model=MODEL,
        max_tokens=1,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "When do you open on Saturdays?"},
        ],
    )
    assert scripted.results[-1].prompt_token_ids == ids
    assert chat.usage.prompt_tokens_details.cached_tokens == second.usage.input_tokens_details.cached_tokens


def test_max_output_tokens_makes_it_incomplete(client, scripted):
    scripted.reply = None  # the tiny model's own reply: it runs to max_output_tokens
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2
    events = list(
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, temperature=0, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == r.output_text


def test_stream_events_and_final_response(client, scripted):
    scripted.reply = "We repair e-bike motors."
    with client.responses.stream(
        model=MODEL, input="Do you repair motors?", instructions=INSTRUCTIONS
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") == -(-len(scripted.reply) // 3)  # 3-character deltas
    assert final.output_text == "We repair e-bike motors."
    assert final.usage.input_tokens == len(scripted.results[-1].prompt_token_ids)
    events = list(
        client.responses.create(
            model=MODEL, input="Do you repair motors?", instructions=INSTRUCTIONS, stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0


def test_function_call_items_in_and_out(client, scripted):
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, light rain"},
    ]
    scripted.reply = "Light rain."
    r = client.responses.create(model=MODEL, input=history, tools=TOOLS, instructions=INSTRUCTIONS)
    assert r.output_text == "Light rain."
    messages = scripted.requests[-1]["messages"]
    assert messages[0]["content"].startswith("# Tools") and messages[0]["content"].endswith(INSTRUCTIONS)
    assert (
        messages[2]["content"]
        == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    assert (
        messages[3]["content"]
        == '<tool_response>{"name": "get_weather", "content": "18 C, light rain"}</tool_response>'
    )
    scripted.reply = (
        'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    r = client.responses.create(model=MODEL, input="And Oslo?", tools=TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert (call.name, call.arguments, call.status) == ("get_weather", '{"city": "Oslo"}', "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    with client.responses.stream(model=MODEL, input="And Oslo?", tools=TOOLS) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == '{"city": "Oslo"}'
    assert final.output_text == "Checking."


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"extra_body": {"prompt_cache_options": {"ttl": "12h"}}}, "prompt_cache_options"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
    ],
)
def test_refusals_name_the_field(client, kwargs, param):
    args = {"model": MODEL, "input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args)
    assert info.value.body["param"] == param
    assert param in info.value.body["message"]
