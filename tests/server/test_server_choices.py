"""``n`` > 1, logprobs and Anthropic stream usage, through the official SDKs against live servers.

``n=3`` prefills the prompt once (the server's ``prefixcache_prefilled_tokens_total`` rises by
the prompt's uncached tokens, once); logprobs are equal cold, as a full hit, as a partial hit
and with the cache off; streamed logprobs add up to the non-streamed ones; Anthropic's
``message_start`` carries the request's input usage, equal to the final usage's input fields.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "test-model"
SYSTEM = "You answer questions about exact prefix caching, briefly and precisely. " * 8


def prefilled(url: str) -> float:
    """The server's prefill-token counter (Prometheus)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "prefixcache_prefilled_tokens_total":
                return s.value
    raise AssertionError("prefixcache_prefilled_tokens_total is missing from /metrics")


def messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def dumped(choice: Any) -> list[dict[str, Any]]:
    return [c.model_dump() for c in choice.logprobs.content]


@pytest.fixture
def server(serve, make_engine):
    return serve(make_engine(), model_name=MODEL)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_n3_prefills_once_and_is_reproducible_with_a_seed(server, client):
    before = prefilled(server.url)
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": messages("Name three colours."),
        "max_tokens": 8,
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
        "logprobs": True,
    }
    r = client.chat.completions.create(**kw)
    u = r.usage
    assert prefilled(server.url) - before == u.prompt_tokens - u.prompt_tokens_details.cached_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one repeated
    assert u.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)  # summed over choices
    again = client.chat.completions.create(**kw)  # now a hit: same choices, same logprobs
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert [dumped(c) for c in again.choices] == [dumped(c) for c in r.choices]
    lone = client.chat.completions.create(**{**kw, "n": 1, "seed": 12})  # choice 1 draws from seed + 1
    assert lone.choices[0].message.content == r.choices[1].message.content


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model=MODEL, messages=messages("hi"), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == e.logprob  # greedy: the sampled token is the best one
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.token == bytes(e.bytes).decode("utf-8", errors="backslashreplace")
    # (The tiny tokenizer's ids 260..511 have no bytes but split a character in its decode, so the
    # bytes add up to the text only on real tokenizers: the SmolLM2 test checks that.)
    plain = client.chat.completions.create(model=MODEL, messages=messages("hi"), max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_logprobs_equal_with_the_cache_on_and_off(serve, make_engine):
    on = serve(make_engine(), model_name=MODEL)
    off = serve(make_engine(enable_cache=False), model_name=MODEL)

    def ask(server: Any, user: str) -> tuple[list[Any], int]:
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = oa.chat.completions.create(
            model=MODEL,
            messages=messages(user),
            max_tokens=6,
            temperature=0.8,
            seed=5,
            n=2,
            logprobs=True,
            top_logprobs=5,
        )
        return [dumped(c) for c in r.choices], r.usage.prompt_tokens_details.cached_tokens

    cold, c0 = ask(on, "What is a block?")
    hit, c1 = ask(on, "What is a block?")
    partial, c2 = ask(on, "What is a TTL?")
    assert c0 == 0 and c1 > 0 and 0 < c2 < c1
    assert cold == hit == ask(off, "What is a block?")[0]
    assert partial == ask(off, "What is a TTL?")[0]


def test_streamed_choices_and_logprobs_add_up_to_the_whole_answer(client):
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": messages("stream it"),
        "max_tokens": 7,
        "n": 2,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text: dict[int, str] = defaultdict(str)
    lps: dict[int, list[Any]] = defaultdict(list)
    finishes: dict[int, list[str]] = defaultdict(list)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.logprobs is not None:
                lps[ch.index] += [e.model_dump() for e in ch.logprobs.content]
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    assert roles == [0, 1]
    for choice in whole.choices:
        assert text[choice.index] == choice.message.content
        assert lps[choice.index] == dumped(choice)
        assert finishes[choice.index] == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_n_logprobs_and_echo(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, n=2, logprobs=3, temperature=1.0, seed=8
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            # The 3 best and the sampled token, keyed by string: ids sharing one string (the tiny
            # tokenizer's unused ids 260..511 are all "") keep the likelier value.
            assert 1 <= len(top) <= 4 and top[token] >= value
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, n=2, logprobs=3, temperature=1.0, seed=8, stream=True
        )
    )
    streamed: dict[int, list[float]] = defaultdict(list)
    for ch in chunks:
        if ch.choices[0].logprobs is not None:
            streamed[ch.choices[0].index] += ch.choices[0].logprobs.token_logprobs
    assert [streamed[i] for i in (0, 1)] == [c.logprobs.token_logprobs for c in r.choices]
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, temperature=0)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert echo.choices[0].text == prompt + plain.choices[0].text
    echoed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, echo=True, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in echoed) == echo.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"n": 17}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_unsupported_completions_combinations_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2, **kwargs)
    assert info.value.body["param"] == param and f"'{param}'" in info.value.body["message"]


def test_anthropic_message_start_carries_the_input_usage(serve, make_engine):
    server = serve(make_engine(), model_name=MODEL)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    fields = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    seen = []
    for _ in range(2):  # a miss that writes blocks, then a hit that reads them
        with an.messages.stream(
            model=MODEL,
            max_tokens=4,
            system=SYSTEM,
            messages=[{"role": "user", "content": "Where is my order?"}],
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        start = next(e for e in events if e.type == "message_start").message.usage
        delta = next(e for e in events if e.type == "message_delta").usage
        assert [getattr(start, f) for f in fields] == [getattr(final.usage, f) for f in fields]
        assert [getattr(delta, f) for f in fields] == [getattr(final.usage, f) for f in fields]
        assert start.output_tokens == 0 and delta.output_tokens == final.usage.output_tokens > 0
        seen.append(start)
    assert seen[0].cache_read_input_tokens == 0 and seen[0].cache_creation_input_tokens > 0
    assert seen[1].cache_read_input_tokens == seen[0].cache_creation_input_tokens


@pytest.mark.model
def test_real_model_n3_one_prefill_logprobs_cache_on_off_and_stream_usage(
    serve, real_runner, one_torch_thread
):
    """SmolLM2 behind two servers (cache on, cache off): n=3 prefills once, the logprobs are
    equal cold, as a hit and with the cache off, streamed logprobs equal them, and Anthropic's
    message_start has the final input usage."""
    from prefixcache.engine import Engine

    engines = [Engine(real_runner, dtype="float32"), Engine(real_runner, dtype="float32", enable_cache=False)]
    on, off = (serve(e, model_name="smollm2") for e in engines)
    system = "You are the support assistant of a bicycle shop. Answer in one short sentence. " * 8
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "Hours?"}]
    kw: dict[str, Any] = {
        "model": "smollm2",
        "max_tokens": 5,
        "n": 3,
        "temperature": 0.7,
        "seed": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "messages": chat,
    }

    def ask(server: Any, **extra: Any) -> Any:
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            **kw, **extra
        )

    before = prefilled(on.url)
    cold = ask(on)
    assert prefilled(on.url) - before == cold.usage.prompt_tokens  # one prompt's worth for three choices
    hit = ask(on)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    ref = [dumped(c) for c in ask(off).choices]
    assert [dumped(c) for c in cold.choices] == [dumped(c) for c in hit.choices] == ref
    streamed: dict[int, list[Any]] = defaultdict(list)
    for chunk in ask(on, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed[ch.index] += [e.model_dump() for e in ch.logprobs.content]
    assert [streamed[i] for i in range(3)] == ref
    for choice in cold.choices:  # SmolLM2's byte-level BPE: the tokens' bytes are the text
        text = b"".join(bytes(e.bytes) for e in choice.logprobs.content if e.token != "<|im_end|>")
        assert text.decode() == choice.message.content
    an = anthropic.Anthropic(base_url=on.url, api_key="x", max_retries=0)
    with an.messages.stream(
        model="smollm2", max_tokens=4, system=system, messages=[{"role": "user", "content": "Hours?"}]
    ) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    assert start.cache_read_input_tokens == final.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_creation_input_tokens) == (
        final.input_tokens,
        final.cache_creation_input_tokens,
    )
    for e in engines:
        e.close()
