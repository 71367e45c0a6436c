"""Prompt logprobs through the official openai client: ``echo`` + ``logprobs`` and vLLM's
``prompt_logprobs``, bitwise what a cold run gives, alone, after a hit and batched."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest

from prefixcache.engine.engine import Engine
from prefixcache.engine.serving.sampling import token_logprobs

MODEL = "tiny"
SHARED = "System: answer briefly and exactly, the same way every time you are asked. " * 2


def _reference(runner: Any, ids: list[int], positions: list[int], top: int) -> dict[int, Any]:
    """Each position's logprob from a cold engine's last row of the prompt cut there."""
    cold = Engine(runner, prefill_chunk=16, enable_cache=False)
    try:
        out = {}
        for k in positions:
            r = cold.generate(prompt_token_ids=ids[:k], max_tokens=1, return_logits=True)
            lp, best = token_logprobs(r.first_logits, ids[k], top)
            rank = int((r.first_logits > r.first_logits[ids[k]]).sum()) + 1
            out[k] = (lp, best, rank)
        return out
    finally:
        cold.close()


def _check(lp: Any, ids: list[int], ref: dict[int, Any], text: Any) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for k, (want, best, _) in ref.items():
        assert lp.token_logprobs[k] == want, k  # JSON carries the float32 value exactly
        expected: dict[str, float] = {}
        for t, v in (*best, (ids[k], want)):  # two ids with one string: the likelier one
            expected.setdefault(text.text(t), v)
        assert lp.top_logprobs[k] == expected


def test_echo_logprobs_equal_a_cold_run_alone_after_a_hit_and_batched(
    serve: Any, make_engine: Any, tiny_runner: Any
) -> None:
    engine = make_engine()
    server = serve(engine, model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    text = server.state.bridge.token_text
    prompts = [SHARED + f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    ids = [engine.prompt_ids(prompt=p) for p in prompts]
    positions = {i: sorted({1, 2, 17, 40, len(x) // 2, len(x) - 1}) for i, x in enumerate(ids)}
    refs = {i: _reference(tiny_runner, ids[i], positions[i], 2) for i in range(4)}

    cold = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    lp = cold.choices[0].logprobs
    assert cold.choices[0].text.startswith(prompts[0])
    assert len(lp.tokens) == len(ids[0]) + cold.usage.completion_tokens
    assert lp.tokens[: len(ids[0])] == [text.text(t) for t in ids[0]]
    assert lp.text_offset[len(ids[0])] == len(prompts[0])  # the output starts after the echo
    _check(lp, ids[0], refs[0], text)

    hit = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    assert hit.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert hit.choices[0].logprobs.top_logprobs == lp.top_logprobs

    out: list[Any] = [None] * 4

    def call(i: int) -> None:
        out[i] = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=6, echo=True, logprobs=2, temperature=0
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(4):
        _check(out[i].choices[0].logprobs, ids[i], refs[i], text)


def test_vllm_prompt_logprobs_and_the_stream_shape(serve: Any, make_engine: Any, tiny_runner: Any) -> None:
    engine = make_engine()
    server = serve(engine, model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    text = server.state.bridge.token_text
    ids = engine.prompt_ids(prompt=SHARED)
    ref = _reference(tiny_runner, ids, [1, 30, len(ids) - 1], 3)
    r = client.completions.create(
        model=MODEL, prompt=SHARED, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for k, (want, best, rank) in ref.items():
        entry = pl[k]
        assert entry[str(ids[k])] == {"logprob": want, "rank": rank, "decoded_token": text.text(ids[k])}
        for place, (token, value) in enumerate(best, start=1):
            assert entry[str(token)]["logprob"] == value
            assert entry[str(token)]["rank"] == (rank if token == ids[k] else place)

    stream = client.completions.create(
        model=MODEL, prompt=SHARED, max_tokens=2, temperature=0, echo=True, logprobs=1, stream=True
    )
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.text == SHARED and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len(ids)
    assert first.logprobs.token_logprobs[30] == ref[30][0]


def test_prompt_logprobs_need_the_own_runner(serve: Any, make_engine: Any) -> None:
    server = serve(make_engine(runner="hf"), model_name=MODEL)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hello there", "max_tokens": 1, "echo": True, "logprobs": 1},
        timeout=60,
    )
    assert r.status_code == 400 and "own Llama runner" in r.json()["error"]["message"]


@pytest.mark.model
def test_real_model_echo_logprobs_are_the_same_cold_after_a_hit_and_batched(
    serve: Any, real_runner: Any
) -> None:
    engine = Engine(real_runner)
    try:
        server = serve(engine, model_name=MODEL)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        prompts = [SHARED + f"Question {i}: name a colour." for i in range(3)]
        want = [engine.prompt_logprobs(prompt=p, top=1) for p in prompts]

        def ask(p: str) -> Any:
            return client.completions.create(
                model=MODEL, prompt=p, max_tokens=4, echo=True, logprobs=1, temperature=0
            )

        first = ask(prompts[0])
        again = ask(prompts[0])
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        out: list[Any] = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, ask(prompts[i]))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for got, ref in [(first, want[0]), (again, want[0])] + list(zip(out, want, strict=True)):
            lp = got.choices[0].logprobs.token_logprobs
            assert lp[0] is None and lp[1 : len(ref)] == [e.logprob for e in ref[1:]]
    finally:
        engine.close()


def test_chat_prompt_logprobs_cover_the_rendered_prompt(serve: Any, make_engine: Any) -> None:
    engine = make_engine()
    server = serve(engine, model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    pl = r.model_extra["prompt_logprobs"]
    ids = engine.prompt_ids(messages=messages)
    want = engine.prompt_logprobs(prompt_token_ids=ids, top=1)
    assert len(pl) == len(ids) == r.usage.prompt_tokens and pl[0] is None
    assert [p[str(t)]["logprob"] for p, t in zip(pl[1:], ids[1:], strict=True)] == [
        e.logprob for e in want[1:]
    ]
