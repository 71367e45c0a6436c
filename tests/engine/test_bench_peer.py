"""The llama.cpp column of ``prefixcache bench`` (``engine/bench_peer.py``): a peer that is not
installed is a skip line with the reason, never an error; figures come from the peer's own JSON."""

from __future__ import annotations

import sys
from pathlib import Path

from prefixcache.engine.bench_peer import PeerResult, peer_lines, run_llamacpp


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
