"""Structured output through the official openai client: chat ``parse`` with a pydantic model,
Responses ``text.format``, vLLM's ``structured_outputs`` on completions; alone and batched, hits
and misses; the answer parses because of the grammar (the same request without one does not)."""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from prefixcache.engine.engine import Engine

MODEL = "tiny"
SYSTEM = "You describe one person as JSON with a name and an age. " * 3


class Person(BaseModel):
    name: Literal["ada", "bob", "cyd"]
    age: int = Field(ge=0, le=120)
    member: bool


#: Person's schema as a strict client sends it (no other properties).
STRICT = {**Person.model_json_schema(), "additionalProperties": False}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Person number {i}."}]


def test_chat_parse_alone_batched_hits_and_misses(serve: Any, make_engine: Any) -> None:
    engine = make_engine()
    client = _client(serve(engine, model_name=MODEL).url)
    plain = client.chat.completions.create(model=MODEL, messages=_messages(0), max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)  # the random model writes no JSON by itself

    first = client.chat.completions.parse(
        model=MODEL, messages=_messages(0), response_format=Person, max_tokens=60, temperature=0
    )
    assert first.choices[0].finish_reason == "stop"
    assert isinstance(first.choices[0].message.parsed, Person)
    # The schema is not in the prompt: the same tokens, and the plain request's blocks are read.
    assert first.usage.prompt_tokens == plain.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens > 0

    out: list[Any] = [None] * 6

    def call(i: int) -> None:
        out[i] = client.chat.completions.parse(
            model=MODEL,
            messages=_messages(i % 3),
            response_format=Person,
            max_tokens=60,
            temperature=1.0,
            seed=i,
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in out:
        assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Person)
    assert engine.grammars.compiled == 1  # compiled once for the schema, then cached


def test_json_object_and_the_beta_parse_and_responses_text_format(serve: Any, make_engine: Any) -> None:
    client = _client(serve(make_engine(), model_name=MODEL).url)
    r = client.chat.completions.create(
        model=MODEL,
        messages=_messages(1),
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
        extra_body={"top_k": 3},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # max_tokens ended it inside an object: the text is a prefix of one
        assert r.choices[0].message.content.startswith("{")
    beta = client.beta.chat.completions.parse(
        model=MODEL, messages=_messages(2), response_format=Person, max_tokens=60, temperature=0
    )
    assert isinstance(beta.choices[0].message.parsed, Person)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": STRICT, "strict": True},
    }
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=_messages(2),
            response_format=fmt,
            max_tokens=60,
            temperature=0,
            n=2,
            stream=True,
        )
    )
    for index in (0, 1):  # each choice keeps its own grammar state
        text = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index
        )
        Person.model_validate_json(text)
    resp = client.responses.parse(
        model=MODEL, input="Describe a person.", text_format=Person, max_output_tokens=60
    )
    assert isinstance(resp.output_parsed, Person)
    assert resp.text.format.type == "json_schema"


def test_completions_regex_and_choice_and_bad_asks(serve: Any, make_engine: Any) -> None:
    url = serve(make_engine(), model_name=MODEL).url
    client = _client(url)
    r = client.completions.create(
        model=MODEL,
        prompt="A code: ",
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    c = client.completions.create(
        model=MODEL, prompt="Pick: ", max_tokens=20, extra_body={"guided_choice": ["north", "south"]}
    )
    assert c.choices[0].text in ("north", "south")
    bad = [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ]
    for extra, param in bad:
        body = {"model": MODEL, "messages": _messages(0), "max_tokens": 4, **extra}
        got = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, (extra, got.text)


def test_the_mask_leaves_the_logits_as_computed(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    try:
        grammar = engine.grammars.compile("json_schema", Person.model_json_schema())
        plain = engine.generate(prompt="Hello there, person", max_tokens=4, return_logits=True, logprobs=2)
        guided = engine.generate(
            prompt="Hello there, person", max_tokens=60, return_logits=True, logprobs=2, grammar=grammar
        )
        assert torch.equal(plain.first_logits, guided.first_logits)
        assert guided.text.startswith("{") and plain.text[:1] != "{"
        # The logprob reported is the model's own (unmasked) distribution's.
        from prefixcache.engine.serving.sampling import token_logprobs

        assert guided.logprobs[0].logprob == token_logprobs(guided.first_logits, guided.tokens[0], 0)[0]
        Person.model_validate_json(guided.text)
    finally:
        engine.close()


@pytest.mark.model
def test_real_model_chat_parse_and_responses(serve: Any, real_runner: Any) -> None:
    engine = Engine(real_runner)
    try:
        client = _client(serve(engine, model_name=MODEL).url)
        messages = [{"role": "user", "content": "Give me a person called bob, aged 30, who is a member."}]
        r = client.chat.completions.parse(
            model=MODEL, messages=messages, response_format=Person, max_tokens=40, temperature=0
        )
        assert isinstance(r.choices[0].message.parsed, Person)
        again = client.chat.completions.parse(
            model=MODEL, messages=messages, response_format=Person, max_tokens=40, temperature=0
        )
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].message.parsed == r.choices[0].message.parsed
        resp = client.responses.parse(
            model=MODEL, input=messages[0]["content"], text_format=Person, max_output_tokens=40
        )
        assert isinstance(resp.output_parsed, Person)
    finally:
        engine.close()


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Lyon", "Oslo"]},
        "days": {"type": "integer", "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_a_forced_tool_call_follows_its_schema_on_openai_and_anthropic(serve: Any, make_engine: Any) -> None:
    import anthropic

    url = serve(make_engine(), model_name=MODEL).url
    client = _client(url)
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": WEATHER, "strict": True}}]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Forecast please."}],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "forecast"}},
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        )
        call = r.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert (
            call.function.name == "forecast" and args["city"] in ("Lyon", "Oslo") and 0 <= args["days"] <= 9
        )
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    m = an.messages.create(
        model=MODEL,
        max_tokens=200,  # room for the whole call: a cut one is stop_reason max_tokens, not tool_use
        extra_body={"temperature": 0.0},  # greedy: the default temperature is 1 and this call has no seed
        tools=[{"name": "forecast", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "forecast"},
        messages=[{"role": "user", "content": "Forecast please."}],
    )
    use = m.content[-1]
    assert use.type == "tool_use" and use.input["city"] in ("Lyon", "Oslo") and m.stop_reason == "tool_use"
