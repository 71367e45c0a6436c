"""The engine builds its runner and KV pool off the caller's thread (``runtime.off_this_thread``),
so the caller keeps no OpenMP thread pool that would compete with the worker's: the build runs on a
thread of its own, its result or its exception comes back unchanged; ``Engine.run_on_worker`` runs
other compute (the benchmark's floors) on the worker's own thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from prefixcache.engine import engine as engine_module
from prefixcache.engine.llama import LlamaRunner
from prefixcache.engine.runtime import off_this_thread


def test_off_this_thread_runs_elsewhere_and_returns_or_raises() -> None:
    here = threading.get_ident()
    assert off_this_thread(threading.get_ident) != here
    assert off_this_thread(lambda: [1, 2]) == [1, 2]

    class Odd(Exception):
        pass

    def fail() -> None:
        raise Odd("from the build thread")

    with pytest.raises(Odd, match="from the build thread"):
        off_this_thread(fail)


def test_the_engine_builds_its_runner_and_pool_off_the_callers_thread(
    tiny_runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {}
    real_select, real_pool = engine_module.select_runner, LlamaRunner.new_pool

    def select(*args: Any, **kwargs: Any) -> Any:
        seen["runner"] = threading.get_ident()
        return real_select(*args, **kwargs)

    def new_pool(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen["pool"] = threading.get_ident()
        return real_pool(self, *args, **kwargs)

    monkeypatch.setattr(engine_module, "select_runner", select)
    monkeypatch.setattr(LlamaRunner, "new_pool", new_pool)
    engine = engine_module.Engine(tiny_runner, prefill_chunk=16)
    try:
        here = threading.get_ident()
        assert seen.keys() == {"runner", "pool"} and here not in seen.values()
        out = engine.generate(prompt_token_ids=list(range(1, 40)), max_tokens=2)
        assert len(out.tokens) == 2  # and it serves as before
    finally:
        engine.close()


def test_run_on_worker_runs_on_the_engines_compute_thread(tiny_runner: Any) -> None:
    engine = engine_module.Engine(tiny_runner, prefill_chunk=16)
    try:
        engine.generate(prompt_token_ids=list(range(1, 20)), max_tokens=1)  # the worker is up
        assert engine.run_on_worker(lambda: threading.current_thread().name) == "prefixcache-engine"

        def fail() -> None:
            raise KeyError("on the worker")

        with pytest.raises(KeyError, match="on the worker"):
            engine.run_on_worker(fail)
        assert engine.generate(prompt_token_ids=list(range(1, 20)), max_tokens=1).tokens  # still serving
    finally:
        engine.close()
