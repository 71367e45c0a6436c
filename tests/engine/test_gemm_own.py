"""The own GEMM (kernels/pc_gemm.c through kernels/matmul.py): the product of F.linear within a
tolerance (float64 reference: a wrong kernel fails), each output row bitwise the same for row
counts 1-17, 32, 64 and 512, at offsets, with 1 and 2 threads, in float32 and bfloat16, on every
GEMM ISA this CPU runs; float32 the same bits on every ISA; PREFIXCACHE_KERNEL_ISA; the GemmRule
that uses it by default and the torch rule as the fallback."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from prefixcache.engine import gemm
from prefixcache.engine.gemm import Rows, gemm_rule
from prefixcache.engine.kernels import matmul

DTYPES = [torch.float32, torch.bfloat16]
COUNTS = [*range(1, 18), 32, 64, 512]
ISAS = [isa for isa in matmul.ISAS if isa in matmul.available()]
#: Against float64: float32 accumulation, or one bf16 rounding of the output (2^-8) plus bf16 inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _data(dtype: torch.dtype, n: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def test_the_kernels_run_a_vector_path_here() -> None:
    assert "generic" in ISAS and len(ISAS) >= 2, matmul.available()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(960, 576), (67, 577), (13, 40)], ids=["960x576", "67x577", "13x40"])
def test_own_linear_is_the_product_of_f_linear(isa: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x, w, b = _data(dtype, *shape, m=37)
    want = F.linear(x.double(), w.double(), b.double())
    for bias in (b, None):
        got = matmul.own_linear(x, w, bias, isa=isa).double()
        ref = want if bias is not None else want - b.double()
        err = (got - ref).abs().max().item()
        assert err <= TOL[dtype] * max(ref.abs().max().item(), 1.0), (isa, err)
    # and the torch path's product, to its rounding
    near = F.linear(x, w, b).double()
    assert torch.allclose(matmul.own_linear(x, w, b, isa=isa).double(), near, atol=2 * TOL[dtype] * 4, rtol=0)


def test_a_wrong_product_fails_the_tolerance() -> None:
    """The check above is not vacuous: one weight off by 2% in one row fails it."""
    x, w, b = _data(torch.float32, 960, 576, 37)
    bad = w.clone()
    bad[5, 7] *= 1.02
    got = matmul.own_linear(x, bad, b).double()
    want = F.linear(x.double(), w.double(), b.double())
    assert (got - want).abs().max().item() > TOL[torch.float32] * want.abs().max().item()


@pytest.mark.parametrize("isa", ISAS[1:])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_rows_are_bitwise_invariant(isa: str, dtype: torch.dtype, threads: int) -> None:
    x, w, b = _data(dtype, 197, 577, 600, seed=threads)
    ref = torch.cat([matmul.own_linear(x[i : i + 1], w, b, isa=isa, threads=1) for i in range(600)])
    for m in COUNTS:
        for off in (0, 3, 21, 88):
            for nt in (1, 2):
                got = matmul.own_linear(x[off : off + m], w, b, isa=isa, threads=nt)
                assert torch.equal(got, ref[off : off + m]), (isa, m, off, nt)


def test_float32_gives_the_same_bits_on_every_isa() -> None:
    x, w, b = _data(torch.float32, 131, 1000, 9)
    outs = [matmul.own_linear(x, w, b, isa=isa) for isa in ISAS]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), ISAS
    # bf16 widened to float32 (no bf16 dot product: generic, avx2, avx512) likewise
    xb, wb, bb = _data(torch.bfloat16, 131, 1000, 9)
    xb[0, 5], xb[1, 7], xb[2, 0] = float("nan"), float("inf"), 3e38  # NaN rows, overflow to inf
    plain = [isa for isa in ISAS if isa not in ("avx512bf16", "amx")]  # not the bf16 dot product or tiles
    widened = [matmul.own_linear(xb, wb, bb, isa=isa).view(torch.int16) for isa in plain]
    assert all(torch.equal(o, widened[0]) for o in widened[1:])  # bit patterns, NaNs included
    assert int(widened[0][0, 0]) == 0x7FC0  # the one NaN torch writes


PROMPT_ISAS = [isa for isa in ISAS if isa != "generic"]


@pytest.mark.parametrize("shape", [(960, 576), (67, 577), (13, 40)], ids=["960x576", "67x577", "13x40"])
def test_the_prompt_rows_gemm_is_the_product_of_f_linear(shape: tuple[int, int]) -> None:
    """The second arithmetic (one FMA chain per output): float64's product within float32's
    tolerance, with and without bias, on every ISA it runs, and the same bits on all of them
    (the AVX2 register tiles over a packed panel, and the plain C chain)."""
    x, w, b = _data(torch.float32, *shape, m=37)
    want = F.linear(x.double(), w.double(), b.double())
    outs = []
    for isa in ISAS:
        for bias in (b, None):
            got = matmul.own_linear(x, w, bias, isa=isa, prompt=True)
            ref = want if bias is not None else want - b.double()
            err = (got.double() - ref).abs().max().item()
            assert err <= TOL[torch.float32] * max(ref.abs().max().item(), 1.0), (isa, err)
        outs.append(matmul.own_linear(x, w, b, isa=isa, prompt=True))
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), ISAS
    # a wrong weight fails the tolerance (the check is not vacuous)
    bad = w.clone()
    bad[shape[0] // 2, shape[1] // 3] *= 1.02
    got = matmul.own_linear(x, bad, b, prompt=True).double()
    assert (got - want).abs().max().item() > TOL[torch.float32] * want.abs().max().item()


@pytest.mark.parametrize("isa", PROMPT_ISAS)
def test_prompt_rows_are_bitwise_invariant_and_not_the_lanes_bits(isa: str, threads: int) -> None:
    """Every row count 1-17, 32, 64, 512 at several offsets, 1 or 2 threads: each row's bits are
    its one-row product's. And they are another arithmetic than the lanes order of decode rows:
    close to it, not the same bits."""
    x, w, b = _data(torch.float32, 197, 577, 600, seed=threads)
    ref = torch.cat(
        [matmul.own_linear(x[i : i + 1], w, b, isa=isa, threads=1, prompt=True) for i in range(600)]
    )
    for m in COUNTS:
        for off in (0, 3, 21, 88):
            for nt in (1, 2):
                got = matmul.own_linear(x[off : off + m], w, b, isa=isa, threads=nt, prompt=True)
                assert torch.equal(got, ref[off : off + m]), (isa, m, off, nt)
    lanes = matmul.own_linear(x, w, b, isa=isa)
    assert torch.allclose(lanes, ref, atol=1e-4, rtol=0) and not torch.equal(lanes, ref)


def test_the_prompt_rows_gemm_takes_float32_only() -> None:
    x, w, b = _data(torch.bfloat16, 16, 32, 3)
    with pytest.raises(TypeError, match="float32 only"):
        matmul.own_linear(x, w, b, prompt=True)
    with pytest.raises(TypeError, match="float32 only"):
        matmul.bound(ISAS[-1], True)(x, w, b)


def test_out_is_written_in_place_and_bad_shapes_are_refused() -> None:
    x, w, b = _data(torch.float32, 64, 96, 10)
    out = torch.full((12, 64), 7.0)
    matmul.own_linear(x, w, b, out=out[1:11])
    assert torch.equal(out[1:11], matmul.own_linear(x, w, b)) and (out[0] == 7).all() and (out[11] == 7).all()
    with pytest.raises(ValueError, match="do not multiply"):
        matmul.own_linear(x, w[:, :95])
    with pytest.raises(TypeError):
        matmul.own_linear(x, w.to(torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_bound_gemm_of_the_hot_path_gives_own_linears_bits(isa: str, dtype: torch.dtype) -> None:
    x, w, b = _data(dtype, 131, 200, 9)
    gemm = matmul.bound(isa)
    assert matmul.bound(isa) is gemm
    for m in (1, 3, 4, 5, 9):
        assert torch.equal(gemm(x[:m], w, b), matmul.own_linear(x[:m], w, b, isa=isa)), m
        assert torch.equal(gemm(x[:m], w), matmul.own_linear(x[:m], w, isa=isa)), m
    wide = torch.cat([x, x], dim=1)[:, :200]  # rows with a stride past K: read in place
    assert torch.equal(gemm(wide, w, b), matmul.own_linear(x, w, b, isa=isa))
    out = torch.zeros(11, 131, dtype=dtype)
    gemm(x, w, b, out[1:10])
    assert (
        torch.equal(out[1:10], matmul.own_linear(x, w, b, isa=isa)) and not out[0].any() and not out[10].any()
    )
    with pytest.raises(ValueError, match="do not multiply"):
        gemm(x, w[:, :199])


def test_a_bound_gemm_for_an_isa_this_machine_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "available", lambda: ("generic",))
    with pytest.raises(matmul.IsaUnavailableError, match="no avx2 path here"):
        matmul.BoundGemm("avx2")


def test_the_environment_caps_the_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    best = ISAS[-1]
    monkeypatch.setenv(matmul.ENV, "avx2")
    assert matmul.gemm_isa(torch.bfloat16) == "avx2" and matmul.gemm_isa(torch.float32) == "avx2"
    rule = gemm_rule(torch.bfloat16, torch.device("cpu"))
    assert rule.own == "avx2" and "-avx2-" in rule.tag()
    # On AVX2 float32 prefill rows take the prompt-rows arithmetic (gemm.PROMPT_ROWS_ISAS), and
    # emulated bf16 prefill rows torch's 128-row pieces (gemm.OWN_PREFILL_ISAS); the tags say so.
    f32, bf16 = (gemm_rule(dtype, torch.device("cpu")) for dtype in (torch.float32, torch.bfloat16))
    assert f32.own_prefill and f32.prompt_rows and "-avx2-prows-" in f32.tag()
    assert not bf16.own_prefill and not bf16.prompt_rows and "-avx2-p128-" in bf16.tag()
    monkeypatch.setenv(matmul.ENV, "auto")
    assert matmul.gemm_isa(torch.bfloat16) == best
    assert matmul.gemm_isa(torch.float32) == ("avx512" if best in ("avx512bf16", "amx") else best)
    monkeypatch.setenv(matmul.ENV, "sse2")
    with pytest.raises(ValueError, match="PREFIXCACHE_KERNEL_ISA must be one of"):
        matmul.gemm_isa(torch.float32)
    monkeypatch.setenv(matmul.ENV, "avx512bf16")
    monkeypatch.setattr(matmul, "available", lambda: ("generic", "avx2"))
    with pytest.raises(matmul.IsaUnavailableError, match="run only generic, avx2"):
        matmul.gemm_isa(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_default_rule_is_own_and_its_rows_are_invariant(dtype: torch.dtype) -> None:
    """Decode rows unpadded through the own GEMM; prefill rows as OWN_PREFILL_ISAS says; a mixed step
    gives each row the bits of its class alone."""
    rule = gemm_rule(dtype, torch.device("cpu"))
    assert rule.own == matmul.gemm_isa(dtype) and rule.tag().startswith(f"gemm-own-v{matmul.version()}-")
    assert rule.padded(5) == 5
    x, w, b = _data(dtype, 576, 576, 300)
    got = rule.linear(x, w, b, Rows(300, ((0, 3, True), (3, 300, False))))
    assert torch.equal(got[:3], matmul.own_linear(x[:3], w, b, isa=rule.own))
    if rule.prompt_rows:  # prefill rows: the prompt-rows arithmetic
        assert torch.equal(got[3:], matmul.own_linear(x[3:], w, b, isa=rule.own, prompt=True))
    for i in (3, 130, 299):
        alone = rule.linear(x[i : i + 1], w, b, Rows(1, ((0, 1, False),)))
        assert torch.equal(got[i], alone[0]), i
    for i in (0, 2):
        assert torch.equal(got[i], rule.linear(x[i : i + 1], w, b, Rows(1, ((0, 1, True),)))[0])


def test_float32_prefill_rows_take_the_prompt_rows_tiles_of_the_machines_isa() -> None:
    """float32 prefill rows go through the prompt-rows arithmetic on the ISA the own GEMM runs
    here (AVX2, or AVX512 where the CPU has it, bf16 CPUs included), and the tag says which."""
    isa = matmul.gemm_isa(torch.float32)  # $PREFIXCACHE_KERNEL_ISA may cap it
    if isa is None:
        pytest.skip("the own GEMM has no SIMD path here")
    rule = gemm_rule(torch.float32, torch.device("cpu"))
    assert rule.own == isa and rule.own_prefill and rule.prompt_rows
    assert rule.tag() == f"gemm-own-v{matmul.version()}-{isa}-prows-d16p"
    x, w, b = _data(torch.float32, 197, 577, 70)
    got = rule.linear(x, w, b, Rows(70, ((0, 70, False),)))
    assert torch.equal(got, matmul.own_linear(x, w, b, isa="generic", prompt=True))


def test_the_avx2_rule_gives_each_class_its_own_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the AVX2 GEMM (forced, so this runs on AVX512 machines too) float32 prefill rows take
    the prompt-rows arithmetic and decode rows the lanes order, in a step mixing both kinds in
    three runs as alone."""
    monkeypatch.setenv(matmul.ENV, "avx2")
    rule = gemm_rule(torch.float32, torch.device("cpu"))
    assert rule.own == "avx2" and rule.prompt_rows and rule.tag().startswith("gemm-own-v1-avx2-prows-")
    x, w, b = _data(torch.float32, 576, 576, 140)
    got = rule.linear(x, w, b, Rows(140, ((0, 2, True), (2, 139, False), (139, 140, True))))
    lanes = matmul.own_linear(x, w, b, isa="avx2")
    prompt = matmul.own_linear(x, w, b, isa="avx2", prompt=True)
    assert torch.equal(got[:2], lanes[:2]) and torch.equal(got[139:], lanes[139:])
    assert torch.equal(got[2:139], prompt[2:139])
    alone = rule.linear(x[2:139], w, b, Rows(137, ((0, 137, False),)))
    assert torch.equal(alone, got[2:139])


def test_the_torch_rule_is_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = gemm_rule(torch.float32, torch.device("cpu"), kernels="torch")
    assert not rule.own and rule.tag() == "gemm-p128-d16p"
    monkeypatch.setattr(gemm, "own_gemm", lambda dtype, kernels=None: ("", False, 0))
    assert gemm_rule(torch.bfloat16, torch.device("cpu")).tag().startswith("gemm-p128-d32")
    x, w, b = _data(torch.float32, 64, 96, 5)
    assert torch.allclose(rule.linear(x, w, b, Rows(5, ((0, 5, True),))), F.linear(x, w, b), atol=1e-5)


def test_the_runners_namespace_names_the_gemm(tiny_runner) -> None:
    from prefixcache.engine.llama import LlamaRunner

    own = LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="native")
    ref = LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="torch")
    assert own.gemm.own and not ref.gemm.own
    other = copy.copy(own)
    other.gemm = ref.gemm
    assert other.fingerprint(16) != own.fingerprint(16)


def test_a_runner_built_under_another_isa_cap_is_not_handed_back(
    tiny_runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """from_model_runner reuses a runner per (dtype, kernels) only under the same
    PREFIXCACHE_KERNEL_ISA: capped to AVX2 after an uncapped build, it gives an AVX2 runner (on
    an AVX512 machine the uncapped one computes AVX512, and a stale reuse kept it)."""
    from prefixcache.engine.llama import LlamaRunner

    monkeypatch.delenv(matmul.ENV, raising=False)
    best = LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="native")
    assert best.gemm.own == matmul.gemm_isa(torch.float32, "auto")
    monkeypatch.setenv(matmul.ENV, "avx2")
    capped = LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="native")
    assert capped.gemm.own == "avx2" and capped.gemm.prompt_rows
    assert LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="native") is capped
    monkeypatch.delenv(matmul.ENV)
    assert LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="native") is best


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_weights_through_the_own_gemm(real_runner, dtype: str) -> None:
    """SmolLM2's own projections and lm_head: close to F.linear, rows invariant 1-17, 32, 64."""
    from prefixcache.engine.llama import LlamaRunner

    runner = LlamaRunner.from_model_runner(real_runner, dtype=dtype, kernels="native")
    assert runner.gemm.own
    dt = runner.dtype
    g = torch.Generator().manual_seed(0)
    for w in (runner.layers[3]["qkv"], runner.layers[3]["down"], runner.lm_head):
        x = torch.randn(64, w.shape[1], generator=g).to(dt)
        one = torch.cat([matmul.own_linear(x[i : i + 1], w, isa=runner.gemm.own) for i in range(64)])
        for m in [*range(1, 18), 32, 64]:
            assert torch.equal(matmul.own_linear(x[:m], w, isa=runner.gemm.own), one[:m]), m
        want = F.linear(x.double(), w.double())
        assert (one.double() - want).abs().max().item() <= TOL[dt] * want.abs().max().item()
