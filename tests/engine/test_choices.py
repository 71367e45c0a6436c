"""``n`` choices from one prefill, and logprobs that do not depend on the cache.

The choices of one request share the prompt's pool blocks (its full blocks read in place, its
last partial block copied per choice); each decodes with its own sampler (seed + index), so
choice i is bitwise what a lone request with that seed gives. Logprobs are the log-softmax of
the very logits row the sampler saw: a cold run, a full hit, a partial hit, the cache off and a
batched run give equal lists (``==`` on Python floats, i.e. bitwise).
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
import torch

from prefixcache.engine import ChoiceDelta, Completion, InvalidRequestError, PromptDone
from prefixcache.engine.engine import Engine


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


def _count_pool_calls(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count ``alloc`` (every block handed out, copies included) and ``copy`` calls on the pool."""
    calls = {"alloc": 0, "copy": 0}
    pool = engine.pool
    real_alloc, real_copy = pool.alloc, pool.copy

    def alloc() -> Any:
        calls["alloc"] += 1
        return real_alloc()

    def copy(block: Any) -> Any:
        calls["copy"] += 1
        return real_copy(block)

    monkeypatch.setattr(pool, "alloc", alloc)
    monkeypatch.setattr(pool, "copy", copy)
    return calls


def test_three_choices_prefill_the_prompt_once_and_share_its_blocks(
    tiny_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 prompt tokens (3 full blocks and 2 tokens of a 4th), 3 choices of 20 tokens: the
    prompt's 4 blocks are allocated once, the partial one copied twice, and each choice gets one
    block of its own for positions 64..68; every block goes back when the request ends."""
    engine = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    free = engine.pool.free_blocks
    calls = _count_pool_calls(engine, monkeypatch)
    c = engine.generate_choices(
        prompt_token_ids=_prompt(1, 50), n=3, max_tokens=20, temperature=1.0, seed=3, top_k=200
    )
    assert [len(ch.tokens) for ch in c.choices] == [20, 20, 20]  # all ran to the length (no EOS)
    assert engine.prefilled_tokens == 50  # one prompt's worth, not three
    assert calls == {"alloc": 4 + 2 + 3, "copy": 2}  # three separate requests would take 15
    assert engine.pool.free_blocks == free
    assert engine.worker_stats().reserved_blocks == 0 and engine.worker_stats().rows == 0
    assert c.usage.prompt_tokens == 50 and c.usage.completion_tokens == 60
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    engine.close()


def test_a_block_aligned_prompt_shares_every_block_and_copies_none(
    tiny_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    free = engine.pool.free_blocks
    calls = _count_pool_calls(engine, monkeypatch)
    kw: dict[str, Any] = {"n": 4, "max_tokens": 3, "temperature": 1.0, "seed": 1, "top_k": 200}
    c = engine.generate_choices(prompt_token_ids=_prompt(2, 48), **kw)
    assert [len(ch.tokens) for ch in c.choices] == [3] * 4
    assert calls == {"alloc": 3 + 4, "copy": 0}  # the prompt's 3 blocks, then one per choice
    assert c.usage.cache_write_tokens == 48 and engine.prefilled_tokens == 48
    # The prompt's blocks stay as cache entries; everything else went back.
    assert free - engine.pool.free_blocks == engine.stats().blocks == 3
    again = engine.generate_choices(prompt_token_ids=_prompt(2, 48), **kw)
    assert engine.prefilled_tokens == 48 + 16  # a hit leaves its last block to compute (>= 1 token)
    assert [ch.tokens for ch in again.choices] == [ch.tokens for ch in c.choices]
    engine.cache.check_integrity()
    engine.close()


@pytest.mark.parametrize("kind", ["auto", "hf"])
def test_choice_i_is_the_lone_request_with_seed_plus_i(tiny_runner: Any, kind: str) -> None:
    """With a seed the choices are reproducible, and choice i equals n=1 with seed + i (tokens,
    text and logprobs, bitwise); the HF runner decodes them one after another from one prefill."""
    engine = Engine(tiny_runner, prefill_chunk=16, runner=kind)
    ids = _prompt(3, 70)
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "logprobs": 3}
    c = engine.generate_choices(prompt_token_ids=ids, n=3, seed=41, **kw)
    assert engine.prefilled_tokens == 70
    assert len({tuple(ch.tokens) for ch in c.choices}) == 3  # three different samples
    for i, choice in enumerate(c.choices):
        lone = engine.generate(prompt_token_ids=ids, seed=41 + i, **kw)
        assert (choice.tokens, choice.text, choice.logprobs) == (lone.tokens, lone.text, lone.logprobs)
    again = engine.generate_choices(prompt_token_ids=ids, n=3, seed=41, **kw)
    assert [ch.logprobs for ch in again.choices] == [ch.logprobs for ch in c.choices]
    greedy = engine.generate_choices(prompt_token_ids=ids, n=3, max_tokens=6)
    assert len({tuple(ch.tokens) for ch in greedy.choices}) == 1
    engine.close()


def test_logprobs_are_the_log_softmax_of_the_sampled_row(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    r = engine.generate(
        prompt_token_ids=_prompt(4, 40), max_tokens=5, logprobs=4, return_logits=True, temperature=1.5, seed=9
    )
    assert len(r.logprobs) == len(r.tokens) == r.usage.completion_tokens
    first = r.logprobs[0]
    lp = torch.log_softmax(r.first_logits, dim=-1)  # raw model logits: before the temperature
    assert first.token == r.tokens[0] and first.logprob == float(lp[first.token])
    assert [t for t, _ in first.top] == torch.topk(lp, 4).indices.tolist()
    assert [v for _, v in first.top] == sorted((v for _, v in first.top), reverse=True)
    for e in r.logprobs:
        assert len(e.top) == 4 and e.logprob <= e.top[0][1] <= 0.0
    greedy = engine.generate(prompt_token_ids=_prompt(4, 40), max_tokens=5, logprobs=0)
    assert all(e.top == () for e in greedy.logprobs)
    assert greedy.logprobs[0].logprob == float(lp.max())  # greedy takes the argmax
    engine.close()


@pytest.mark.parametrize(("kind", "chunk"), [("auto", 16), ("hf", 32)])
def test_logprobs_are_equal_cold_hit_partial_and_cache_off(tiny_runner: Any, kind: str, chunk: int) -> None:
    """What vLLM got wrong (#3251, #8268, PR #42245): logprobs must not depend on how much of
    the prompt came from the cache. Ours come from the same logits, which a hit gives bitwise."""
    on = Engine(tiny_runner, prefill_chunk=chunk, runner=kind)
    off = Engine(tiny_runner, prefill_chunk=chunk, runner=kind, enable_cache=False)
    base = _prompt(5, 150)
    other = base[:100] + _prompt(6, 30)  # shares 100 tokens: a partial hit
    kw: dict[str, Any] = {"max_tokens": 8, "logprobs": 5, "temperature": 0.7, "seed": 2, "n": 2}

    def lps(engine: Engine, ids: list[int]) -> tuple[list[Any], Any]:
        c = engine.generate_choices(prompt_token_ids=ids, **kw)
        return [ch.logprobs for ch in c.choices], c.choices[0].usage

    cold, u_cold = lps(on, base)
    hit, u_hit = lps(on, base)
    partial, u_partial = lps(on, other)
    assert u_cold.cached_tokens == 0 and u_hit.cached_tokens > 0 and 0 < u_partial.cached_tokens < 100 + 1
    assert cold == hit == lps(off, base)[0]
    assert partial == lps(off, other)[0]
    on.close()
    off.close()


def test_logprobs_are_equal_when_batched_with_other_requests(tiny_runner: Any) -> None:
    on = Engine(tiny_runner, prefill_chunk=16)
    off = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    prompts = [_prompt(7, 60) + _prompt(10 + i, 5 + 9 * i) for i in range(5)]
    out: list[Any] = [None] * len(prompts)

    def call(i: int) -> None:
        out[i] = on.generate_choices(
            prompt_token_ids=prompts[i], n=1 + i % 3, max_tokens=6, logprobs=2, temperature=1.0, seed=i
        )

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert on.worker_stats().steps > 0 and sum(c.usage.cached_tokens for c in out) > 0
    for i, c in enumerate(out):
        ref = off.generate_choices(
            prompt_token_ids=prompts[i], n=1 + i % 3, max_tokens=6, logprobs=2, temperature=1.0, seed=i
        )
        assert [ch.logprobs for ch in c.choices] == [ch.logprobs for ch in ref.choices]
    on.close()
    off.close()


def test_the_stream_reports_usage_first_then_indexed_deltas(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    items = list(
        engine.stream_choices(
            prompt="Tell me a story about a cat. " * 3,
            n=3,
            max_tokens=10,
            logprobs=1,
            temperature=1.0,
            seed=4,
        )
    )
    done, deltas, last = items[0], items[1:-1], items[-1]
    assert isinstance(done, PromptDone) and isinstance(last, Completion)
    assert all(isinstance(d, ChoiceDelta) for d in deltas)
    assert done.usage == type(done.usage)(
        last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.cache_write_tokens, 0
    )
    text: dict[int, str] = defaultdict(str)
    lps: dict[int, list[Any]] = defaultdict(list)
    finishes: dict[int, list[str]] = defaultdict(list)
    for d in deltas:
        text[d.index] += d.text
        lps[d.index] += d.logprobs
        if d.finish_reason:
            finishes[d.index].append(d.finish_reason)
    for ch in last.choices:
        assert text[ch.index] == ch.text and lps[ch.index] == ch.logprobs
        assert finishes[ch.index] == [ch.finish_reason]
    engine.close()


def test_closing_a_stream_of_choices_frees_every_block(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    free = engine.pool.free_blocks
    stream = engine.stream_choices(
        prompt_token_ids=_prompt(8, 70), n=4, max_tokens=200, temperature=1.0, top_k=100
    )
    for item in stream:
        if isinstance(item, ChoiceDelta):
            break
    stream.close()
    assert engine.pool.free_blocks == free and engine.queue_depth == 0
    assert engine.worker_stats().reserved_blocks == 0 and engine.worker_stats().rows == 0
    engine.close()


def test_bad_n_and_logprobs_are_clear_errors(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16, max_batch=4, kv_reserve_tokens=2048)  # 128 blocks
    assert engine.max_n == 4
    for kw, needle in [
        ({"n": 0}, "n must be"),
        ({"n": 5}, "max_batch"),
        ({"n": True}, "n must be"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ]:
        with pytest.raises(InvalidRequestError, match=needle):
            engine.generate_choices(prompt="hi", max_tokens=2, **kw)
    with pytest.raises(InvalidRequestError, match="need 256 KV blocks"):  # could never be admitted
        engine.generate_choices(prompt_token_ids=list(range(10)), max_tokens=1000, n=4)
    with pytest.raises(InvalidRequestError, match="stream_choices"):
        engine.generate(prompt="hi", max_tokens=2, n=2)
    assert engine.generate_choices(prompt="hi", max_tokens=2, n=4).usage.completion_tokens <= 8
    engine.close()


def test_an_overdue_request_that_does_not_fit_is_not_overtaken(tiny_runner: Any) -> None:
    """max_batch 2, A running (1 row): B (n=2) does not fit, C (n=1) would. B waited past
    max_wait_s, so C may not take the free row before it: B runs after A, C after B."""
    engine = Engine(
        tiny_runner, prefill_chunk=16, max_batch=2, max_wait_s=0.0
    )  # every waiter overdue at once
    order: list[str] = []

    def run(name: str, n: int) -> None:
        for item in engine.stream_choices(
            prompt_token_ids=_prompt(len(name) + n, 20),
            n=n,
            max_tokens=30,
            temperature=1.0,
            seed=1,
            top_k=100,
        ):
            if isinstance(item, PromptDone):
                order.append(name)

    threads = {
        name: threading.Thread(target=run, args=(name, n)) for name, n in (("A", 1), ("B", 2), ("CC", 1))
    }
    with engine.runner.lock:  # A is admitted, then its first step waits here
        threads["A"].start()
        while not engine.worker_stats().running:
            time.sleep(0.005)
        threads["B"].start()
        while engine.queue_depth < 2:
            time.sleep(0.005)
        threads["CC"].start()
        while engine.queue_depth < 3:
            time.sleep(0.005)
    for t in threads.values():
        t.join(60)
    assert order == ["A", "B", "CC"]
    engine.close()


@pytest.mark.model
def test_real_model_logprobs_equal_cold_hit_partial_and_cache_off(real_runner: Any) -> None:
    """SmolLM2 (own runner, float32): logprobs of three choices, cold, as a full hit, as a
    partial hit, and with the cache off, all ``==``; the prompt prefilled once per request."""
    on = Engine(real_runner, dtype="float32")
    off = Engine(real_runner, dtype="float32", enable_cache=False)
    system = "You are a helpful assistant for a bicycle shop. Answer briefly and politely. " * 6
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}]
    other = [msgs[0], {"role": "user", "content": "Do you fix brakes?"}]
    kw: dict[str, Any] = {"max_tokens": 6, "logprobs": 5, "temperature": 0.8, "seed": 1, "n": 3}

    def run(engine: Engine, messages: list[dict[str, str]]) -> tuple[list[Any], Any]:
        before = engine.prefilled_tokens
        c = engine.generate_choices(messages=messages, **kw)
        u = c.usage
        assert engine.prefilled_tokens - before == u.prompt_tokens - u.cached_tokens
        return [ch.logprobs for ch in c.choices], u

    cold, u_cold = run(on, msgs)
    hit, u_hit = run(on, msgs)
    partial, u_partial = run(on, other)
    assert u_cold.cached_tokens == 0 and u_hit.cached_tokens == (u_cold.prompt_tokens - 1) // 16 * 16
    assert 0 < u_partial.cached_tokens < u_partial.prompt_tokens
    assert cold == hit == run(off, msgs)[0]
    assert partial == run(off, other)[0]
    assert all(len(lp) == 6 or lp[-1].token in real_runner.eos_token_ids for lp in cold)
    on.close()
    off.close()
