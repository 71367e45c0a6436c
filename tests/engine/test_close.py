"""Closing an engine: ``close()`` returns once the requests already queued are done and the
worker thread has ended, so a script that closes its engine exits cleanly. A daemon worker
thread still running when the interpreter finalizes was stopped by ``pthread_exit`` inside
torch's C++ code (the thread letting go of the runner's tensors as its loop returned): the
process aborted with "terminate called without an active exception" (exit 134) after its work
was done, as ``benchmarks/bench_tenants.py`` did. An engine never closed is closed by an exit
hook (``worker._close_at_exit``): a script that forgets ``close()`` exits 0 too (it aborted in
about one run of four)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from prefixcache.engine.engine import Engine
from prefixcache.engine.serving import worker as worker_module
from prefixcache.engine.types import Completion, EngineClosedError

SRC = Path(__file__).resolve().parents[2] / "src"
WORKER_NAME = "prefixcache-engine"


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == WORKER_NAME}


def test_close_waits_for_the_queued_request_and_the_worker_thread(tiny_runner: Any) -> None:
    before = _workers()
    engine = Engine(tiny_runner, prefill_chunk=16)
    started = threading.Event()
    ends: list[Completion] = []

    def consume() -> None:
        for item in engine.stream_choices(prompt="a request in flight at close", max_tokens=24):
            started.set()
            if isinstance(item, Completion):
                ends.append(item)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert started.wait(60), "the request did not start"
    mine = _workers() - before
    assert len(mine) == 1  # this engine's worker
    engine.close()
    assert not any(t.is_alive() for t in mine), "close() returned with the worker thread still running"
    consumer.join(10)
    assert not consumer.is_alive()
    assert len(ends) == 1  # the request in flight ran to its end
    engine.close()  # idempotent


def test_a_script_that_closes_its_smollm2_engine_exits_0(tmp_path: Path) -> None:
    script = tmp_path / "one_request.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(SRC)!r})
            from prefixcache.engine import Engine

            def main():
                engine = Engine(None, threads=1)  # the embedded SmolLM2
                engine.generate(messages=[{{"role": "user", "content": "Hello"}}], max_tokens=2)
                engine.close()
                print("done", flush=True)

            main()
            """
        )
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "done" in run.stdout, run.stderr[-2000:]
    assert "terminate called" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_exit_hook_closes_an_engine_nobody_closed(tiny_runner: Any) -> None:
    before = _workers()
    engine = Engine(tiny_runner, prefill_chunk=16)
    idle = Engine(tiny_runner, prefill_chunk=16)  # never started: no thread to end
    engine.generate(prompt="left open", max_tokens=2)
    mine = _workers() - before
    assert len(mine) == 1 and all(t.is_alive() for t in mine)
    worker_module._close_at_exit()
    assert not any(t.is_alive() for t in mine), "the exit hook left the worker thread running"
    with pytest.raises(EngineClosedError):
        engine.generate(prompt="after exit", max_tokens=1)
    assert idle.generate(prompt="still open", max_tokens=1).tokens  # never started: left alone
    idle.close()


def test_a_script_that_never_closes_its_smollm2_engine_exits_0(tmp_path: Path) -> None:
    script = tmp_path / "left_open.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(SRC)!r})
            from prefixcache.engine import Engine

            engine = Engine(None)  # the embedded SmolLM2, default threads, never closed
            engine.generate(prompt_token_ids=list(range(100, 200)), max_tokens=5)
            print("done", flush=True)
            """
        )
    )
    for _ in range(3):  # it aborted in about one run of four without the hook
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert "done" in run.stdout, run.stderr[-2000:]
        assert "terminate called" not in run.stderr, run.stderr[-2000:]
        assert run.returncode == 0, run.stderr[-2000:]
