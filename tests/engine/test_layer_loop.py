"""The layer loop in compiled code (``pc_layers``, kernels/pc_forward.c) against the Python loop
over the same kernels: the same logits and the same KV, bit for bit, in both dtypes, for decode
batches of mixed context lengths and (where the GEMM rule sends prefill rows to the own GEMM)
prefill chunks; which steps take it (a spy on the library call), and SmolLM2."""

from __future__ import annotations

import copy
import ctypes
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_invariance import _Prompt

from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.model import ModelRunner

DTYPES = ["float32", "bfloat16"]


class _Calls(list[int]):
    """pc_layers calls: each call's row count; ``formats``: each call's weight format; ``prompt``:
    whether it sent prompt rows through the prompt-rows GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.formats: list[int] = []
        self.prompt: list[int] = []


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts pc_layers calls (each call's row count) while the test runs."""
    from prefixcache.engine import kernels

    k = kernels.load("native")
    assert k is not None
    real = k.lib.pc_layers
    calls = _Calls()

    def counted(*args: Any) -> int:
        calls.append(int(args[4]))  # (dt, isa, weight format, prompt rows, rows, ...)
        calls.formats.append(int(args[2]))
        calls.prompt.append(int(args[3]))
        return int(real(*args))

    monkeypatch.setattr(k.lib, "pc_layers", counted)
    yield calls


def _pair(base: ModelRunner, dtype: str) -> tuple[LlamaRunner, LlamaRunner]:
    compiled = LlamaRunner.from_model_runner(base, dtype=dtype, kernels="native")
    assert compiled.native is not None and compiled.gemm.own
    python = copy.copy(compiled)
    python.layer_loop = "python"
    return compiled, python


def _scenario(runner: LlamaRunner, seed: int, prefill: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three prompts (lengths 37, 300 and 1 tokens past ``prefill``-token chunks), then 6 decode
    steps of all three at once, then one step of their decode rows around a fourth prompt: every
    step's logits and the pool afterwards."""
    rng = random.Random(seed)
    pool = runner.new_pool(96)
    pool.data.zero_()
    lengths = (37, 300, 1)
    prompts = [_Prompt(runner, pool, [rng.randrange(runner.vocab_size) for _ in range(n)]) for n in lengths]
    out: list[torch.Tensor] = []
    for p in prompts:
        for a in range(0, len(p.ids), prefill):
            b = min(a + prefill, len(p.ids))
            out.append(runner.step(pool, [Segment(p.ids[a:b], a, p.table, want_logits=b == len(p.ids))]))
    ends = [len(p.ids) for p in prompts]
    for step in range(6):
        segs = [
            Segment([rng.randrange(runner.vocab_size)], end + step, p.table, decode=True, want_logits=True)
            for p, end in zip(prompts, ends, strict=True)
        ]
        out.append(runner.step(pool, segs))
    # a step mixing them: decode rows, a new prompt, a decode row (three runs of two kinds)
    late = _Prompt(runner, pool, [rng.randrange(runner.vocab_size) for _ in range(20)])
    segs = [
        Segment([rng.randrange(runner.vocab_size)], end + 6, p.table, decode=True, want_logits=True)
        for p, end in zip(prompts, ends, strict=True)
    ]
    segs.insert(2, Segment(late.ids, 0, late.table, want_logits=True))
    out.append(runner.step(pool, segs))
    return out, pool.data.clone()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_loop_computes_the_python_loops_bits(
    tiny_runner: ModelRunner, dtype: str, spy: list[int]
) -> None:
    compiled, python = _pair(tiny_runner, dtype)
    got, got_kv = _scenario(compiled, 1, prefill=64)
    decode_calls = [r for r in spy if r == 3]
    assert len(decode_calls) == 6  # every decode step of three rows ran in compiled code
    assert (23 in spy) == compiled.gemm.own_prefill  # the mixed step, where prefill rows may go
    spy.clear()
    want, want_kv = _scenario(python, 1, prefill=64)
    assert spy == []  # the Python loop never calls it
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    assert torch.equal(got_kv, want_kv)


def test_the_compiled_loop_runs_prompt_rows_through_the_prompt_rows_gemm(
    tiny_runner: ModelRunner, spy: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the AVX2 GEMM (forced, so AVX512 machines run it too), float32 prefill and mixed
    steps run in compiled code with the prompt rows through pc_gemm_rows, and give the Python
    loop's bits (which splits the runs in GemmRule.linear)."""
    from prefixcache.engine.kernels import matmul

    monkeypatch.setenv(matmul.ENV, "avx2")
    compiled, python = _pair(tiny_runner, "float32")
    assert compiled.gemm.prompt_rows
    got, got_kv = _scenario(compiled, 2, prefill=64)
    assert 23 in spy and set(spy.prompt) == {1}  # type: ignore[attr-defined]
    want, want_kv = _scenario(python, 2, prefill=64)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    assert torch.equal(got_kv, want_kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_steps_take_the_compiled_loop_only_where_the_own_gemm_computes_prefill(
    tiny_runner: ModelRunner, dtype: str, spy: list[int]
) -> None:
    compiled, _ = _pair(tiny_runner, dtype)
    pool = compiled.new_pool(16)
    p = _Prompt(compiled, pool, list(range(5, 45)))
    compiled.step(pool, [Segment(p.ids, 0, p.table, want_logits=True)])
    assert spy == ([40] if compiled.gemm.own_prefill else [])
    assert spy.prompt == ([int(compiled.gemm.prompt_rows)] if compiled.gemm.own_prefill else [])  # type: ignore[attr-defined]
    # a step mixing prefill rows with a decode row follows the same rule
    spy.clear()
    q = _Prompt(compiled, pool, list(range(7, 20)))
    mixed = [Segment([9], 40, p.table, decode=True), Segment(q.ids, 0, q.table, want_logits=True)]
    compiled.step(pool, mixed)
    assert spy == ([14] if compiled.gemm.own_prefill else [])


def _q4(
    n: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16, isa: str | None = None, a8: bool = False
) -> Any:
    from prefixcache.engine.quant import Q4Weight

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=gen) / 50).half().float()  # float16 values, as in a GGUF
    m = (-torch.rand(n, k // 32, generator=gen) / 10).half().float()
    return Q4Weight(q, d, m, dtype, isa, a8)


def test_a_four_bit_weights_kernel_view_follows_its_dense_tensor() -> None:
    """pc_layers reads a 4-bit projection through a pc_q4w (nibbles, scales, mins, dense): built
    once, and again when ``dense`` is another tensor (the runner swaps in the float runner's)."""
    from prefixcache.engine.kernels import q4

    if q4.load() is None:
        pytest.skip("the quantized kernels are not built here")
    w = _q4(64, 64, 1)
    at = w.kernel_view()
    assert at == w.kernel_view()  # the same view while dense is the same tensor
    fields = lambda a: list((ctypes.c_void_p * 4).from_address(a))  # noqa: E731
    assert fields(at) == [w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), w.dense.data_ptr()]
    w.dense = w.dense.clone()
    assert fields(w.kernel_view())[3] == w.dense.data_ptr()


def test_the_weight_pointers_are_kept_until_a_weight_object_changes(tiny_runner: ModelRunner) -> None:
    """layer_pointers reads the ~300 pointers once per runner and step kind, and again at the
    step after any weight in ``layers`` (or a 4-bit weight's ``dense``) is another object."""
    from prefixcache.engine.kernels import q4
    from prefixcache.engine.llama_native import layer_pointers

    shared, _ = _pair(tiny_runner, "float32")
    # its own copy with its own layer dicts: the runner from_model_runner hands out is shared by
    # the session's later tests, which must not meet the weights swapped below
    compiled = copy.copy(shared)
    compiled.layers = [dict(lw) for lw in shared.layers]
    downs = [lw["down"] for lw in shared.layers]
    first = layer_pointers(compiled)
    assert first is not None and layer_pointers(compiled) is first  # the same array, not re-read
    assert layer_pointers(compiled, decode_only=True) is not first  # each step kind its own
    down = compiled.layers[1]["down"]
    compiled.layers[1]["down"] = down.clone()  # a weight replaced in place, between steps
    again = layer_pointers(compiled)
    assert again is not None and again is not first
    at = list(again[0]).index(compiled.layers[1]["down"].data_ptr())  # the new tensor's memory
    assert first[0][at] == down.data_ptr() != again[0][at]
    assert layer_pointers(copy.copy(compiled)) is not again  # another runner reads its own
    if q4.load() is None:
        return
    compiled.layers = [dict(lw) for lw in compiled.layers]
    for lw in compiled.layers:
        for name in ("qkv", "o", "gu", "down"):
            lw[name] = _q4(lw[name].shape[0], lw[name].shape[1], 1, torch.float32, compiled.gemm.own)
    four = layer_pointers(compiled, decode_only=True)
    assert four is not None and four[1] == 1 and layer_pointers(compiled, decode_only=True) is four
    w = compiled.layers[0]["qkv"]
    w.dense = w.dense.clone()  # the 4-bit weight's dense swapped: its view is rebuilt
    assert layer_pointers(compiled, decode_only=True) is not four
    assert all(lw["down"] is down_ for lw, down_ in zip(shared.layers, downs, strict=True))


def test_mixed_four_bit_or_strided_weights_keep_the_python_loop(
    tiny_runner: ModelRunner, spy: list[int]
) -> None:
    from prefixcache.engine.llama_native import layer_pointers

    compiled, _ = _pair(tiny_runner, "bfloat16")
    assert layer_pointers(compiled) is not None
    n, k = compiled.layers[1]["down"].shape
    for odd_down in (_q4(n, k, 0), compiled.layers[1]["down"].t().contiguous().t()):
        odd = copy.copy(compiled)
        odd.layers = [dict(lw) for lw in compiled.layers]
        odd.layers[1]["down"] = odd_down  # one layer's product 4-bit, the others dense; or strided
        assert layer_pointers(odd, decode_only=True) is None
        pool = odd.new_pool(8)
        p = _Prompt(odd, pool, [3, 4, 5])
        odd.step(pool, [Segment(p.ids, 0, p.table)])
        odd.step(pool, [Segment([6], 3, p.table, decode=True, want_logits=True)])
        assert spy == []
    assert layer_pointers(compiled) is not None  # the original's weights are untouched


@pytest.mark.parametrize("a8", [False, True], ids=["q4", "q4a8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_four_bit_weights_compute_the_dequantized_float_runners_bits(
    tiny_runner: ModelRunner, dtype: str, a8: bool, spy: list[int]
) -> None:
    """A runner on 4-bit weights (decode rows on the quantized kernel: decode-only steps in
    compiled code, and where the own GEMM takes prefill, mixed steps too, their prompt rows on the
    dequantized weights) gives the Python loop's logits and KV, step by step, and (q4) bitwise
    those of a runner whose dense weights are the same values dequantized. With 8-bit rows
    (``--weights q4a8``: pc_q4a8_linear, through the pc_q4w's a8 field) it gives the Python loop's
    bits but not the dense runner's (another arithmetic: a runner that skipped the 8-bit rows
    would give the dense bits)."""
    from prefixcache.engine.kernels import q4
    from prefixcache.engine.llama_native import PROJECTIONS

    if q4.load() is None:
        pytest.skip("the quantized kernels are not built here")
    # a copy: the runner _pair returns is the one the base keeps for every later test
    dense = copy.copy(_pair(tiny_runner, dtype)[0])
    quant = copy.copy(dense)
    dense.layers = [dict(lw) for lw in dense.layers]
    quant.layers = [dict(lw) for lw in dense.layers]
    for i, (lw, qw) in enumerate(zip(dense.layers, quant.layers, strict=True)):
        for j, name in enumerate(PROJECTIONS):
            w = _q4(*lw[name].shape, seed=10 * i + j, dtype=dense.dtype, isa=dense.gemm.own, a8=a8)
            qw[name], lw[name] = w, w.dense
            qw[f"{name}_b"] = lw[f"{name}_b"] = None
    python = copy.copy(quant)
    python.layer_loop = "python"
    got, got_kv = _scenario(quant, 3, prefill=64)
    calls, formats = list(spy), spy.formats  # type: ignore[attr-defined]
    if quant.gemm.own_prefill:  # the last, mixed step: compiled, decode runs on the 4-bit
        assert calls[-1] == 23 and formats[-1] == 2  # weights, the prompt run on the dequantized
        calls, formats = calls[:-1], formats[:-1]
    assert calls[-6:] == [3] * 6 and formats[-6:] == [1] * 6  # decode steps: 4-bit, compiled
    spy.clear()
    want, want_kv = _scenario(python, 3, prefill=64)
    assert spy == []
    ref, ref_kv = _scenario(dense, 3, prefill=64)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    assert torch.equal(got_kv, want_kv)
    if a8:
        assert not torch.equal(got[-1], ref[-1])  # the decode rows' logits: 8-bit rows, not dense
        assert torch.allclose(got[-1].float(), ref[-1].float(), atol=0.5, rtol=0.1)
    elif dense.gemm.own != "amx":  # AMX tiles have their own bits (pc_q4.c)
        assert all(torch.equal(a, c) for a, c in zip(got, ref, strict=True))
        assert torch.equal(got_kv, ref_kv)


@pytest.mark.model
def test_smollm2_decode_in_compiled_code_equals_the_python_loop(
    real_runner: ModelRunner, spy: list[int]
) -> None:
    compiled, python = _pair(real_runner, real_runner.dtype_name)
    got, got_kv = _scenario(compiled, 2, prefill=128)
    assert sum(1 for r in spy if r == 3) == 6
    want, want_kv = _scenario(python, 2, prefill=128)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(got_kv, want_kv)
