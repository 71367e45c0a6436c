"""The llama.cpp column of ``prefixcache bench`` (``engine/bench_peer.py``): a peer that is not
installed, crashes or stalls is a skip line with the reason, never an error; figures come from the
peer's own JSON, measured in turn with the own runner's (a stand-in ``llama_cpp`` module runs the
real peer script and protocol here: the package itself takes minutes to compile)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prefixcache.engine.bench_peer import LlamaCppPeer, PeerResult, peer_lines, run_llamacpp


def test_a_missing_interpreter_is_a_skip_saying_how_to_install(tmp_path: Path) -> None:
    peer = run_llamacpp(
        tmp_path / "nope" / "python", tmp_path / "m.gguf", threads=2, vocab=100, prefill_tokens=64
    )
    assert peer.skipped.startswith(f"{tmp_path / 'nope' / 'python'} does not exist")
    assert "pip install llama-cpp-python" in peer.skipped
    assert peer_lines(peer, 10.0, 100.0, q4=False) == ["## llama.cpp", "", f"skipped: {peer.skipped}", ""]


def test_an_interpreter_without_llama_cpp_is_a_skip_naming_the_import_error(tmp_path: Path) -> None:
    peer = run_llamacpp(sys.executable, tmp_path / "m.gguf", threads=2, vocab=100, prefill_tokens=64)
    assert peer.skipped.startswith(f"llama.cpp failed through {sys.executable}: ")
    assert "llama_cpp" in peer.skipped  # ModuleNotFoundError: No module named 'llama_cpp'


def test_figures_become_a_table_with_the_ratio_and_its_target() -> None:
    peer = PeerResult(version="0.3.36", decode_tps=100.0, prefill_tokens=2112, prefill_tps=400.0)
    lines = peer_lines(peer, 80.0, 500.0, q4=False)
    assert "| decode, one stream (tok/s) | 80.0 | 100.0 | 0.80x | >= 0.7x |" in lines
    assert "| cold prefill, 2112 tokens, one pass (tok/s) | 500 | 400 | 1.25x | |" in lines
    assert "| decode, one stream (tok/s) | 80.0 | 100.0 | 0.80x | >= 1x |" in peer_lines(
        peer, 80.0, 500.0, q4=True
    )


def test_a_peer_that_crashes_is_a_skip_naming_the_signal(tmp_path: Path) -> None:
    """llama-cpp-python 0.3.36 segfaults in its AMX matmul on an AMX Xeon: the column says so."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -SEGV $$\n")
    fake.chmod(0o755)
    peer = run_llamacpp(fake, tmp_path / "m.gguf", threads=2, vocab=100, prefill_tokens=64)
    assert peer.skipped == f"llama.cpp crashed (SIGSEGV) through {fake}"


_FAKE_LLAMA_CPP = '''
"""A stand-in for llama_cpp with its API's shape: logs each call with the time it ran."""
import os, time
__version__ = "0.0-fake"
def _log(*parts):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(" ".join(str(p) for p in (time.monotonic(), *parts)) + "\\n")
class Llama:
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_batch, verbose):
        _log("load", n_threads, n_ctx)
    def generate(self, prompt, top_k, temp, reset):
        _log("decode", *prompt)
        if os.environ.get("FAKE_LLAMA_HANG"):
            time.sleep(3600)
        while True:
            time.sleep(0.001)
            yield 7
    def reset(self):
        pass
    def eval(self, ids):
        _log("prefill", len(ids))
        time.sleep(0.01)
'''


def _fake_peer_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "llama_cpp.py").write_text(_FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = tmp_path / "peer.log"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return log


def test_the_peer_is_measured_in_turn_with_the_own_runner_on_the_same_tokens(
    tiny_runner: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One own decode, then the peer's on the same prompt, and so on; the peer's one-pass
    prefills of the same long prompt between the own ones; its figures from its own answers."""
    from prefixcache.engine import bench
    from prefixcache.engine.engine import Engine

    log = _fake_peer_env(tmp_path, monkeypatch)
    own: list[tuple[float, list[int]]] = []
    real = Engine.generate

    def logged(self: Engine, *a: Any, **kw: Any) -> Any:
        out = real(self, *a, **kw)
        if kw.get("max_tokens") == bench.DECODE_TOKENS + 1:
            own.append((time.monotonic(), list(kw["prompt_token_ids"])))
        return out

    monkeypatch.setattr(Engine, "generate", logged)
    with LlamaCppPeer(sys.executable, tmp_path / "m.gguf", threads=2, n_ctx=256, timeout_s=60) as peer:
        res = bench.run_bench(tiny_runner, kind="llama", lengths=(32,), tail=16, repeats=3, peer=peer)
        figures = peer.result()
    events = [line.split() for line in log.read_text().splitlines()]
    assert events[0][1:] == ["load", "2", "256"]
    decodes = [(float(e[0]), [int(t) for t in e[2:]]) for e in events if e[1] == "decode"]
    assert [p for _, p in decodes] == [p for _, p in own]  # the same prompts, in the same order
    for i, (t, _) in enumerate(decodes):  # each right after the own generation on its prompt
        assert own[i][0] < t and (i + 1 == len(own) or t < own[i + 1][0])
    assert [e[2] for e in events if e[1] == "prefill"] == [str(res.prefill_tokens)] * 3
    assert figures.skipped == "" and figures.version == "0.0-fake"
    assert figures.prefill_tokens == res.prefill_tokens == 48
    assert len(peer.decode_rates) == 3 and figures.decode_tps == sorted(peer.decode_rates)[1]
    assert 0 < figures.decode_tps < 1000  # one token a millisecond at most
    assert figures.prefill_tps == pytest.approx(48 / min(peer.prefill_s))


def test_a_peer_that_stops_answering_is_a_skip_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_peer_env(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_LLAMA_HANG", "1")
    peer = LlamaCppPeer(sys.executable, tmp_path / "m.gguf", threads=2, n_ctx=256, timeout_s=2)
    t = time.monotonic()
    assert peer.decode([1, 2, 3], 10) is None
    assert 2 <= time.monotonic() - t < 30
    assert peer.skipped == f"llama.cpp gave no answer within 2 s through {sys.executable}"
    assert peer.prefill([1, 2]) is None and peer.decode([1], 5) is None  # no more waiting
    assert peer.result().skipped == peer.skipped
    peer.close()
