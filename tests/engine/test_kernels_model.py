"""The own runner on the native kernels: close to the torch path (the numerical reference), rows
invariant (a prompt split at every 16-token block, alone and batched; the checks of
test_invariance.py), cache on equal to cache off, both dtypes; the kernel set in the cache
namespace; the torch fallback when the kernels cannot be built, and PREFIXCACHE_KERNELS."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from typing import Any

import pytest
import torch
from test_invariance import _check_invariance, _kv, _Prompt, _run

from prefixcache.engine.engine import Engine
from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.model import ModelRunner

DTYPES = ["float32", "bfloat16"]


def _native(base: ModelRunner, dtype: str) -> LlamaRunner:
    runner = LlamaRunner.from_model_runner(base, dtype=dtype, kernels="native")
    assert runner.native is not None and runner.kernels.startswith("native-")
    return runner


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_logits_are_close_to_the_torch_path(tiny_runner: ModelRunner, dtype: str) -> None:
    """The same model: float32 within 1e-4, bfloat16 within its rounding; same argmax."""
    ids = list(range(5, 305))
    out = {}
    for kind in ("native", "torch"):
        runner = LlamaRunner.from_model_runner(tiny_runner, dtype=dtype, kernels=kind)
        pool = runner.new_pool(64)
        out[kind] = _run(runner, pool, _Prompt(runner, pool, ids), [0, 77])
    exact = LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="torch")
    pool = exact.new_pool(64)
    ref = _run(exact, pool, _Prompt(exact, pool, ids), [0])
    tol = 1e-4 if dtype == "float32" else 0.1
    scale = ref.abs().max().item()
    assert (out["native"] - ref).abs().max().item() <= tol * scale
    assert int(out["native"].argmax()) == int(ref.argmax())
    if dtype == "float32":
        assert torch.allclose(out["native"], out["torch"], atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_rows_are_invariant(tiny_runner: ModelRunner, dtype: str) -> None:
    runner = _native(tiny_runner, dtype)
    for seed, n in enumerate([70, 333, 700]):
        assert _check_invariance(runner, n, seed) == [], (dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_split_at_every_block_alone_and_batched(tiny_runner: ModelRunner, dtype: str) -> None:
    runner = _native(tiny_runner, dtype)
    rng = random.Random(dtype)
    n = 200
    pool = runner.new_pool(8 * (n // 16 + 8) + 40)
    ids = [rng.randrange(0, runner.vocab_size) for _ in range(n)]
    ref = _Prompt(runner, pool, ids)
    whole = _run(runner, pool, ref, [0])
    whole_kv = _kv(pool, ref, n)
    other = _Prompt(runner, pool, [rng.randrange(0, runner.vocab_size) for _ in range(40)])
    runner.step(pool, [Segment(other.ids, 0, other.table)])
    for cut in range(16, n, 16):
        p = _Prompt(runner, pool, ids)
        assert torch.equal(_run(runner, pool, p, [0, cut]), whole), cut
        assert torch.equal(_kv(pool, p, n), whole_kv), cut
        # batched: the tail shares its step with another request's decode row
        q = _Prompt(runner, pool, ids)
        runner.step(pool, [Segment(ids[:cut], 0, q.table)])
        got = runner.step(
            pool,
            [
                Segment([7], 40, other.table, decode=True, want_logits=True),
                Segment(ids[cut:], cut, q.table, want_logits=True),
            ],
        )
        assert torch.equal(got[1], whole), cut
        p.free()
        q.free()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_on_equals_cache_off_on_the_kernels(tiny_runner: ModelRunner, dtype: str) -> None:
    runner = _native(tiny_runner, dtype)
    on = Engine(runner, prefill_chunk=48)
    off = Engine(runner, prefill_chunk=48, enable_cache=False)
    rng = random.Random(3)
    base = [rng.randrange(0, 256) for _ in range(230)]
    prompts = [base, base[:100] + [1, 2, 3], base[:64] + [rng.randrange(0, 256) for _ in range(50)], base]
    hits = 0
    for ids in prompts:
        a = on.generate(prompt_token_ids=ids, max_tokens=6, return_logits=True)
        b = off.generate(prompt_token_ids=ids, max_tokens=6, return_logits=True)
        assert torch.equal(a.first_logits, b.first_logits) and a.tokens == b.tokens
        hits += a.usage.cached_tokens
    assert hits >= 96 + 64 + 224
    on.cache.check_integrity()


def test_the_namespace_names_the_kernel_set(tiny_runner: ModelRunner) -> None:
    native = _native(tiny_runner, "bfloat16")
    torch_path = LlamaRunner.from_model_runner(tiny_runner, dtype="bfloat16", kernels="torch")
    assert torch_path.native is None and torch_path.kernels == "torch"
    assert native.fingerprint(16) != torch_path.fingerprint(16)
    assert native.native is not None and native.native.isa in native.kernels
    # the SDPA control never runs on the kernels
    assert native.with_attention("sdpa").native is None


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_without_a_compiler_the_torch_path_runs_and_says_why(tmp_path: Any) -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from prefixcache.engine import kernels\n"
        "from prefixcache.engine.llama import LlamaRunner\n"
        "from prefixcache.engine.model import ModelRunner\n"
        "r = LlamaRunner.from_model_runner(ModelRunner.tiny(), dtype='float32')\n"
        "print('KERNELS', r.kernels, '|', kernels.describe())\n"
    )
    env = {"CC": str(tmp_path / "no-such-cc"), "PATH": str(tmp_path), "PREFIXCACHE_HOME": str(tmp_path)}
    env.pop("PREFIXCACHE_KERNELS", None)
    done = _python(code, **env, PREFIXCACHE_KERNELS="auto")
    assert done.returncode == 0, done.stderr
    assert "KERNELS torch | torch (native kernels unavailable: no C compiler found" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "using the torch path" in line]
    assert len(warnings) == 1, done.stderr
    forced = _python(code, **env, PREFIXCACHE_KERNELS="native")
    assert forced.returncode != 0 and "KernelsUnavailableError" in forced.stderr
    assert "no C compiler found" in forced.stderr


def test_the_environment_forces_the_torch_path() -> None:
    code = (
        "from prefixcache.engine import kernels\n"
        "from prefixcache.engine.llama import LlamaRunner\n"
        "from prefixcache.engine.model import ModelRunner\n"
        "r = LlamaRunner.from_model_runner(ModelRunner.tiny(), dtype='float32')\n"
        "print('KERNELS', r.kernels, '|', kernels.describe())\n"
    )
    done = _python(code, PREFIXCACHE_KERNELS="torch")
    assert done.returncode == 0, done.stderr
    assert "KERNELS torch | torch (PREFIXCACHE_KERNELS=torch)" in done.stdout
    bad = _python(code, PREFIXCACHE_KERNELS="fast")
    assert bad.returncode != 0 and "PREFIXCACHE_KERNELS must be one of auto, native, torch" in bad.stderr


@pytest.mark.model
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_on_the_kernels_is_invariant_and_close(real_runner: ModelRunner, dtype: str) -> None:
    runner = _native(real_runner, dtype)
    ids = list(range(1000, 1300))
    pool = runner.new_pool(64)
    got = _run(runner, pool, _Prompt(runner, pool, ids), [0, 77])
    ref_runner = LlamaRunner.from_model_runner(real_runner, dtype="float32", kernels="torch")
    pool = ref_runner.new_pool(64)
    ref = _run(ref_runner, pool, _Prompt(ref_runner, pool, ids), [0])
    tol = 1e-3 if dtype == "float32" else 0.1
    assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert int(got.argmax()) == int(ref.argmax())
    assert _check_invariance(runner, 611, 1) == []


def test_a_block_outside_the_pool_is_refused_before_the_kernels_run(tiny_runner: ModelRunner) -> None:
    runner = _native(tiny_runner, "bfloat16")
    pool = runner.new_pool(8)
    with pytest.raises(IndexError, match="outside the pool"):
        runner.step(pool, [Segment(list(range(20)), 0, [1, 8], want_logits=True)])
    with pytest.raises(IndexError):  # too short a table: refused by the slot lookup
        runner.step(pool, [Segment(list(range(40)), 0, [1, 2], want_logits=True)])
