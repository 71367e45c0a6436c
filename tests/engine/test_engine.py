"""Engine behaviour on the tiny model: usage numbers, errors, streaming, cancellation, queue."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from prefixcache.engine import (
    EmptyPromptError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
    RequestCancelledError,
)
from prefixcache.engine.engine import Engine
from prefixcache.engine.model import ModelRunner


def _refs(engine: Engine) -> int:
    return sum(b.ref_count for b in engine.cache.store)


def _ok(engine: Engine) -> None:
    r = engine.generate(prompt="still serving", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_exact_blocks_hit_and_written(tiny_engine: Engine) -> None:
    ids = list(range(40))
    r = tiny_engine.generate(prompt_token_ids=ids, max_tokens=1)
    assert (r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.cache_write_tokens) == (40, 0, 32)
    r = tiny_engine.generate(prompt_token_ids=ids, max_tokens=1)
    assert (r.usage.cached_tokens, r.usage.cache_write_tokens, r.outcome) == (32, 0, "hit")
    r = tiny_engine.generate(prompt_token_ids=ids + list(range(100, 130)), max_tokens=1)  # 70 tokens
    assert (r.usage.cached_tokens, r.usage.cache_write_tokens) == (32, 32)
    r = tiny_engine.generate(prompt_token_ids=ids[:20] + [255] * 30, max_tokens=1)  # diverges in block 1
    assert (r.usage.cached_tokens, r.usage.cache_write_tokens, r.outcome) == (16, 32, "partial")
    s = tiny_engine.stats()
    assert (s.hit_tokens, s.written_tokens, s.blocks) == (80, 96, 6)
    assert _refs(tiny_engine) == 0
    tiny_engine.cache.check_integrity()


def test_hf_runner_hits_align_to_the_prefill_chunk(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=32, runner="hf")
    assert engine.alignment == 32 and not engine.batched
    ids = list(range(70))
    r = engine.generate(prompt_token_ids=ids, max_tokens=1)
    assert r.usage.cache_write_tokens == 64  # complete chunks only
    r = engine.generate(prompt_token_ids=ids[:50] + [1] * 10, max_tokens=1)
    assert r.usage.cached_tokens == 32  # 48 tokens match, rounded down to the chunk


def test_own_runner_hits_and_writes_every_full_block(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=32)
    assert engine.alignment == 16 and engine.batched
    ids = list(range(70))
    r = engine.generate(prompt_token_ids=ids, max_tokens=1)
    assert r.usage.cache_write_tokens == 64  # every full block, the last partial chunk's too
    r = engine.generate(prompt_token_ids=ids[:50] + [1] * 10, max_tokens=1)
    assert (r.usage.cached_tokens, r.usage.cache_write_tokens) == (48, 0)  # 48 tokens match: all read


def test_tenants_and_ttl(tiny_engine: Engine, fake_clock: Any) -> None:
    ids = list(range(50))
    tiny_engine.generate(prompt_token_ids=ids, max_tokens=1, tenant="a", salt=b"secret-a")
    assert (
        tiny_engine.generate(
            prompt_token_ids=ids, max_tokens=1, tenant="b", salt=b"secret-b"
        ).usage.cached_tokens
        == 0
    )
    assert (
        tiny_engine.generate(
            prompt_token_ids=ids, max_tokens=1, tenant="a", salt=b"secret-a"
        ).usage.cached_tokens
        == 48
    )
    fake_clock.advance(301)
    assert (
        tiny_engine.generate(
            prompt_token_ids=ids, max_tokens=1, tenant="a", salt=b"secret-a"
        ).usage.cached_tokens
        == 0
    )
    tiny_engine.generate(prompt_token_ids=ids, max_tokens=1, ttl_s=3600)
    fake_clock.advance(1000)
    assert tiny_engine.generate(prompt_token_ids=ids, max_tokens=1).usage.cached_tokens == 48


def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(tiny_engine: Engine) -> None:
    cases: list[tuple[type[Exception], dict[str, Any], str]] = [
        (EmptyPromptError, {"prompt": ""}, "empty"),
        (EmptyPromptError, {"messages": []}, "empty"),
        (EmptyPromptError, {"prompt_token_ids": []}, "empty"),
        (PromptTooLongError, {"prompt_token_ids": [1] * 2100}, "2048"),
        (InvalidRequestError, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (InvalidRequestError, {"prompt": "x", "temperature": -1.0}, "temperature"),
        (InvalidRequestError, {"prompt": "x", "temperature": 0.7, "top_p": 0.0}, "top_p"),
        (InvalidRequestError, {"prompt": "x", "top_k": -2}, "top_k"),
        (InvalidRequestError, {"prompt_token_ids": [10**6]}, "vocabulary"),
        (InvalidRequestError, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one"),
    ]
    for exc, kwargs, needle in cases:
        kwargs.setdefault("max_tokens", 4)
        with pytest.raises(exc) as info:
            tiny_engine.generate(**kwargs)
        assert isinstance(info.value, ValueError) and needle in str(info.value)
        _ok(tiny_engine)
    with pytest.raises(PromptTooLongError, match=r"2100.*2048"):
        tiny_engine.generate(prompt_token_ids=[1] * 2100, max_tokens=1)
    assert _refs(tiny_engine) == 0


def test_nonexistent_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="nope.gguf.*does not exist.*gguf"):
        Engine(str(missing))
    assert issubclass(ModelNotFoundError, ValueError)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        ModelRunner.load(tmp_path)


def test_stream_deltas_make_the_text(tiny_engine: Engine) -> None:
    items = list(tiny_engine.stream(prompt="stream me", max_tokens=24, temperature=0.9, seed=3))
    result = items[-1]
    assert all(isinstance(x, str) and x for x in items[:-1])
    assert "".join(items[:-1]) == result.text
    again = tiny_engine.generate(prompt="stream me", max_tokens=24, temperature=0.9, seed=3)
    assert again.tokens == result.tokens  # seeded sampling is reproducible


def test_closing_a_stream_releases_refs(tiny_engine: Engine) -> None:
    ids = list(range(64))
    tiny_engine.generate(prompt_token_ids=ids, max_tokens=1)
    gen = tiny_engine.stream(prompt_token_ids=ids, max_tokens=200)
    got = 0
    for item in gen:
        got += isinstance(item, str)
        if got >= 2:
            break
    gen.close()
    assert _refs(tiny_engine) == 0 and tiny_engine.queue_depth == 0
    tiny_engine.cache.check_integrity()
    _ok(tiny_engine)


def test_cancel_event_stops_generation(tiny_engine: Engine) -> None:
    cancel = threading.Event()
    steps = {"n": 0}

    def cancelled() -> bool:
        steps["n"] += 1
        if steps["n"] == 5:
            cancel.set()
        return cancel.is_set()

    with pytest.raises(RequestCancelledError):
        tiny_engine.generate(prompt_token_ids=list(range(40)), max_tokens=500, cancel=cancelled)
    assert _refs(tiny_engine) == 0 and tiny_engine.queue_depth == 0
    _ok(tiny_engine)


def test_queue_full_raises_at_once(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16, max_queue=1)
    gate, entered = threading.Event(), threading.Event()

    def hold() -> bool:  # runs on the worker between steps: keeps the first request busy
        entered.set()
        gate.wait(30)
        return False

    t = threading.Thread(target=lambda: engine.generate(prompt="a", max_tokens=2, cancel=hold))
    t.start()
    assert entered.wait(30)
    assert engine.queue_depth == 1
    with pytest.raises(QueueFullError, match="max_queue=1"):
        engine.generate(prompt="b", max_tokens=2)
    gate.set()
    t.join(30)
    assert engine.queue_depth == 0
    _ok(engine)
    engine.close()


def test_concurrent_callers_get_the_sequential_answers(tiny_engine: Engine) -> None:
    prompts = [f"question {i} " * (i + 1) for i in range(6)]
    expected = [tiny_engine.generate(prompt=p, max_tokens=5).tokens for p in prompts]
    got: dict[int, list[int]] = {}

    def call(i: int) -> None:
        got[i] = tiny_engine.generate(prompt=prompts[i], max_tokens=5).tokens

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(6)] == expected
    assert _refs(tiny_engine) == 0


def test_shared_runner_and_pin(tiny_runner: Any, fake_clock: Any) -> None:
    a = Engine(tiny_runner, prefill_chunk=16, clock=fake_clock, default_ttl_s=10)
    b = Engine(tiny_runner, prefill_chunk=16)
    assert a.runner is b.runner and a.fingerprint == b.fingerprint
    ids = list(range(48))
    a.generate(prompt_token_ids=ids, max_tokens=1)
    assert a.pin(prompt=ids) == 48
    fake_clock.advance(100)
    assert a.generate(prompt_token_ids=ids + [3], max_tokens=1).usage.cached_tokens == 48
    assert b.generate(prompt_token_ids=ids + [3], max_tokens=1).usage.cached_tokens == 0  # its own cache


def test_cache_off_engine(tiny_runner: Any) -> None:
    off = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    r = off.generate(prompt_token_ids=list(range(40)), max_tokens=3)
    assert (r.usage.cached_tokens, r.usage.cache_write_tokens, r.outcome) == (0, 0, "miss")
    assert off.cache is None and off.stats().requests == 0


def test_stop_string_and_eos(tiny_engine: Engine) -> None:
    free = tiny_engine.generate(prompt="stop test", max_tokens=30, temperature=1.0, seed=7)
    visible = free.text
    if len(visible) >= 3:
        stop = visible[1:3]
        r = tiny_engine.generate(prompt="stop test", max_tokens=30, temperature=1.0, seed=7, stop=[stop])
        assert r.finish_reason == "stop" and r.stop_sequence == stop and stop not in r.text
        assert visible.startswith(r.text)


def test_a_request_that_fails_after_its_step_fails_alone(
    tiny_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while committing one request's blocks ends that request with the error; the
    step loop keeps serving, and nothing stays held."""
    engine = Engine(tiny_runner, prefill_chunk=16)
    real_commit = engine.cache.commit

    def commit(m: Any, *args: Any, **kwargs: Any) -> Any:
        if m.prompt_tokens == 77:
            raise RuntimeError("the tier is on fire")
        return real_commit(m, *args, **kwargs)

    monkeypatch.setattr(engine.cache, "commit", commit)
    with pytest.raises(RuntimeError, match="on fire"):
        engine.generate(prompt_token_ids=list(range(77)), max_tokens=2)
    r = engine.generate(prompt_token_ids=list(range(40)), max_tokens=2)
    assert r.usage.cache_write_tokens == 32
    assert _refs(engine) == 0 and engine.queue_depth == 0 and engine.worker_stats().reserved_blocks == 0
    engine.close()
