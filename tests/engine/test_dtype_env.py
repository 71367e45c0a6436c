"""``$PREFIXCACHE_DTYPE`` sets the default compute dtype of the library and the CLI (float32 or
bfloat16); any other value is refused with a message naming the variable, before a model loads."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.engine.engine import Engine
from prefixcache.engine.model import DTYPE_ENV, default_dtype, env_dtype, machine_dtype
from prefixcache.engine.runtime import describe_runtime


@pytest.mark.parametrize("value", ["float32", "bfloat16"])
def test_the_variable_sets_the_default_dtype_of_an_engine(monkeypatch, tiny_runner, value: str) -> None:
    monkeypatch.setenv(DTYPE_ENV, value)
    assert env_dtype() == value and default_dtype() == value
    engine = Engine(tiny_runner, prefill_chunk=16)
    try:
        assert engine.runner.dtype_name == value
        assert engine.block_layout.dtype == value
        assert engine.pool is not None and engine.pool.dtype == getattr(torch, value)
        assert engine.generate(prompt="hello there", max_tokens=3).usage.completion_tokens == 3
    finally:
        engine.close()


def test_an_explicit_dtype_wins_over_the_variable(monkeypatch, tiny_runner) -> None:
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    engine = Engine(tiny_runner, prefill_chunk=16, dtype="float32")
    try:
        assert engine.runner.dtype_name == "float32"
    finally:
        engine.close()


def test_unset_or_empty_means_the_machine_default(monkeypatch) -> None:
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    assert env_dtype() is None and default_dtype() == machine_dtype()
    monkeypatch.setenv(DTYPE_ENV, "  ")
    assert env_dtype() is None and default_dtype() == machine_dtype()


@pytest.mark.parametrize("value", ["float16", "fp32", "bf16", "Float32"])
def test_another_value_is_refused_naming_the_variable(monkeypatch, tiny_runner, value: str) -> None:
    monkeypatch.setenv(DTYPE_ENV, value)
    with pytest.raises(ValueError, match=rf"PREFIXCACHE_DTYPE must be one of float32, bfloat16.*{value!r}"):
        default_dtype()
    with pytest.raises(ValueError, match="PREFIXCACHE_DTYPE"):
        Engine(tiny_runner, prefill_chunk=16)


def test_the_cli_refuses_a_bad_value_in_one_line_with_exit_2(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(DTYPE_ENV, "double")
    missing = tmp_path / "none.gguf"  # never reached: the variable is checked first
    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(missing)])
    assert result.exit_code == 2
    assert "PREFIXCACHE_DTYPE must be one of float32, bfloat16" in result.output
    assert "Traceback" not in result.output and "none.gguf" not in result.output


def test_the_start_up_line_names_runner_dtype_source_threads_and_kernels(monkeypatch, tiny_runner) -> None:
    other = "float32" if machine_dtype() == "bfloat16" else "bfloat16"
    monkeypatch.setenv(DTYPE_ENV, other)
    engine = Engine(tiny_runner, prefill_chunk=16)
    try:
        line = describe_runtime(engine)
        assert line.startswith(f"runner llama, dtype {other} ($PREFIXCACHE_DTYPE), weights {other}, ")
        assert f"cpu, {tiny_runner.threads} threads, kernels: " in line
    finally:
        engine.close()
    monkeypatch.delenv(DTYPE_ENV)
    engine = Engine(tiny_runner, prefill_chunk=16)
    try:
        assert f"dtype {machine_dtype()} (this machine's default)" in describe_runtime(engine)
    finally:
        engine.close()
