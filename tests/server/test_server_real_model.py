"""The embedded SmolLM2 behind the server: a second request that shares a long system prompt
reads it from the cache, as both APIs' usage fields report."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "smollm2"
# A long shared system prompt (the own runner reads every full 16-token block of it).
SYSTEM = (
    "You are the support assistant of a small bicycle shop. Answer in one short sentence. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; closed on Sundays. "
    "We repair brakes, gears, wheels and e-bike motors, and we sell city, road and cargo bikes. "
) * 12


@pytest.mark.model
def test_shared_system_prompt_is_read_from_the_cache_in_both_apis(serve, real_engine, one_torch_thread):
    assert real_engine.alignment == 16
    server = serve(real_engine, model_name=MODEL)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)

    def ask(question: str):
        return oa.chat.completions.create(
            model=MODEL,
            max_tokens=8,
            temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )

    first = ask("When are you open on Saturday?")
    assert first.choices[0].message.content.strip()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    written = first.usage.prompt_tokens_details.cache_write_tokens
    assert written == first.usage.prompt_tokens // 16 * 16  # every full block
    second = ask("Do you repair e-bike motors?")
    cached = second.usage.prompt_tokens_details.cached_tokens

    def ids(question: str) -> list[int]:
        return real_engine.render_ids(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        )

    a, b = ids("When are you open on Saturday?"), ids("Do you repair e-bike motors?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert cached == shared // 16 * 16 > 500  # every full block of the shared prefix
    third = an.messages.create(
        model=MODEL,
        max_tokens=8,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Do you sell cargo bikes?"}],
    )
    u = third.usage
    assert u.cache_read_input_tokens == cached  # same system prompt, same tokens, same blocks
    question = {"role": "user", "content": "Do you sell cargo bikes?"}
    whole = real_engine.count_tokens(messages=[{"role": "system", "content": SYSTEM}, question])
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == whole
    real_engine.cache.check_integrity()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_opening_hours",
            "description": "Opening hours of the shop on a given day.",
            "parameters": {"type": "object", "properties": {"day": {"type": "string"}}, "required": ["day"]},
        },
    }
]


@pytest.mark.model
def test_tool_loop_with_the_real_model_reads_tools_and_system_from_the_cache(
    serve, real_engine, one_torch_thread
):
    from server_helpers import Scripted

    recorder = Scripted(real_engine, reply=None)  # the model's own replies; prompts recorded
    server = serve(recorder, model_name=MODEL)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open on Saturday?"}]
    ask = {"model": MODEL, "temperature": 0, "tools": TOOLS}
    first = oa.chat.completions.create(max_tokens=24, messages=messages, **ask)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_opening_hours", "arguments": '{"day": "Saturday"}'},
    }
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "10:00-16:00"},
    ]
    second = oa.chat.completions.create(max_tokens=16, messages=messages, **ask)
    assert second.choices[0].message.content
    ids = recorder.results[0].prompt_token_ids
    im_end = real_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools_and_system = ids.index(im_end) + 1  # the system turn: the tools section, then SYSTEM
    assert real_engine.tokenizer.decode(ids[:tools_and_system]).count("get_opening_hours") == 1
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= tools_and_system
    assert cached == len(ids) // 16 * 16  # turn 1's whole prompt is turn 2's prefix
    real_engine.cache.check_integrity()


# A Hermes-style template that renders tools (as Qwen2.5 / SmolLM3 do): tools in the system turn,
# calls as <tool_call> JSON, results as <tool_response> user turns.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages and messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.model
def test_a_template_that_renders_tools_is_used_and_keeps_turns_a_prefix_of_the_next(real_runner):
    import copy

    from prefixcache.engine.prompts import encode
    from prefixcache.server.errors import APIError
    from prefixcache.server.tools.prompt import (
        CallSyntax,
        FunctionTool,
        PromptRenderer,
        ToolCall,
        ToolChoice,
        ToolConfig,
        assistant_turn,
        tool_turn,
    )

    tok = copy.copy(real_runner.tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    tools = (FunctionTool("get_opening_hours", "Opening hours.", {"type": "object"}),)
    renderer = PromptRenderer(ToolConfig(tools), tok, lambda m, gen: "unused")
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Saturday?"}]
    turn2 = [
        *turn1,
        assistant_turn("", [ToolCall("call_1", "get_opening_hours", '{"day": "Saturday"}')]),
        tool_turn("call_1", "get_opening_hours", "10-16"),
    ]
    assert renderer.uses_template(turn1) and renderer.syntax is CallSyntax.TAGGED
    text1, text2 = renderer.render(turn1).text, renderer.render(turn2).text
    assert text1.startswith('<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n{"type": "function"')
    call = '{"name": "get_opening_hours", "arguments": {"day": "Saturday"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in text2
    ids1, ids2 = encode(tok, text1), encode(tok, text2)
    assert ids2[: len(ids1)] == ids1  # turn 1's prompt is a token prefix of turn 2's: its blocks are reused
    forced = PromptRenderer(ToolConfig(tools, ToolChoice.REQUIRED), tok, lambda m, gen: "unused")
    assert forced.render(turn1).assistant_prefix == "<tool_call>"
    tok.chat_template = TOOL_TEMPLATE.replace("<tool_call>", "<call>")  # another call syntax
    json_renderer = PromptRenderer(ToolConfig(tools, ToolChoice.REQUIRED), tok, lambda m, gen: "unused")
    assert json_renderer.syntax is CallSyntax.JSON
    with pytest.raises(APIError, match="tool_choice"):
        json_renderer.render(turn1)


@pytest.mark.model
def test_issue_11_inputs_against_the_embedded_model(serve, real_engine, one_torch_thread):
    """What issue 11 tried against `prefixcache serve`, one request each, on the real tokenizer."""
    import time

    import httpx

    server = serve(real_engine, model_name=MODEL)
    url = server.url + "/v1/chat/completions"
    head = b'{"model":"smollm2","max_tokens":2,"messages":[{"role":"user","content":'
    # A lone surrogate: the HF tokenizer raises TypeError on it; a 400 naming the field, before it.
    r = httpx.post(url, content=head + b'"\\ud800"}]}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    assert real_engine.prefilled_tokens == 0
    with pytest.raises(Exception, match="surrogate"):  # the library refuses it too, before the tokenizer
        real_engine.tokenize("\ud800")
    # temperature 1e-40: greedy, not a NaN after the prefill.
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    greedy = httpx.post(url, json={**body, "temperature": 0}, timeout=120).json()
    tiny = httpx.post(url, json={**body, "temperature": 1e-40}, timeout=120)
    assert tiny.status_code == 200 and tiny.json()["choices"] == greedy["choices"]
    # seed 2**64: a 400 that names seed.
    r = httpx.post(url, json={**body, "seed": 1 << 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    # Over the context x 81 bytes (663,552 for SmolLM2's 8,192 tokens) but under the body limit:
    # a 400 at once, without tokenizing; a 60 MB message: a 413 before parsing.
    assert real_engine.max_prompt_bytes == real_engine.context_len * 81
    start = time.monotonic()
    r = httpx.post(url, json={**body, "messages": [{"role": "user", "content": "x " * 400_000}]}, timeout=120)
    assert r.status_code == 400 and "context" in r.text and time.monotonic() - start < 5
    start = time.monotonic()
    huge = {**body, "messages": [{"role": "user", "content": "x" * 60_000_000}]}
    r = httpx.post(url, json=huge, timeout=120)
    assert r.status_code == 413 and time.monotonic() - start < 10
