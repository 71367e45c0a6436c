"""The quantized kernels (``kernels/pc_q4.c``): Q4_1 and Q8_0 weights read in place, every output
bitwise what the own GEMM gives on the dequantized weights, for every GEMM ISA this machine runs,
both dtypes, K with and without a partial set of 16 groups, row counts 1-17, 32, 64 at offsets,
1 and 2 threads, and every lanes path (AVX512, AVX2, scalar); a corrupted scale fails."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.kernels import matmul, q4

KERNEL = q4.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the native kernels are not built here")
N = 208
DTYPES = [torch.float32, torch.bfloat16]


def _isas(dtype: torch.dtype) -> list[str]:
    """The GEMM ISAs the quantized kernels reproduce here for ``dtype`` (AMX's tiles excepted)."""
    out = [i for i in matmul.available() if i != "amx"]
    return [i for i in out if not (dtype == torch.float32 and i == "avx512bf16")]


def _q4(
    seed: int = 0, k: int = 576, n: int = N
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed nibbles, float16 d, float16 m, the dequantized float32 weights), some scales
    subnormal or zero, as a GGUF can hold them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    m = (-8 * d.float() + torch.randn(n, k // 32, generator=gen) * 0.001).half()
    d[0, 0], d[1, 0], d[2, 0] = 1e-7, 3e-6, 0.0  # float16 subnormals and a zero
    m[3, 0], m[4, 0] = -2e-7, -0.0
    dense = (q.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None]).view(n, k)
    return q4.pack(q), d, m, dense


def _q8(seed: int = 0, k: int = 576, n: int = N) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k // 32, 32), dtype=torch.int8, generator=gen)
    w[0, 0] = -128
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    d[1, 0] = 1e-7
    return w, d, (w.float() * d.float()[..., None]).view(n, k)


@pytest.mark.parametrize("k", [576, 1536, 96, 32], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_outputs_are_the_own_gemms_on_the_dequantized_weights(dtype: torch.dtype, k: int) -> None:
    assert KERNEL is not None
    qs, d, m, dense = _q4(1, k)
    w8, d8, dense8 = _q8(2, k)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    for isa in _isas(dtype):
        want = matmul.own_linear(x, dense.to(dtype), isa=isa)
        want8 = matmul.own_linear(x, dense8.to(dtype), isa=isa)
        for path in (0, 1, 2):  # the lanes paths (the bf16 dot product has one)
            assert torch.equal(KERNEL.linear(x, qs, d, m, isa=isa, path=path), want), (isa, path)
            assert torch.equal(KERNEL.linear8(x, w8, d8, isa=isa, path=path), want8), (isa, path)
    exact = x.double() @ dense.double().T
    assert torch.allclose(
        KERNEL.linear(x, qs, d, m).double(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max()
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_every_tile_shape_gives_the_own_gemms_bits(dtype: torch.dtype) -> None:
    """Each row count up to 9 against N = 211 (52 whole quads of columns, then 3 lone columns),
    so every tile a path has runs (on AVX2 a lone row takes four columns a call, more rows one;
    the lone columns one at a time)."""
    assert KERNEL is not None
    qs, d, m, dense = _q4(10, 96, n=211)
    w8, d8, dense8 = _q8(11, 96, n=211)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(12)).to(dtype)
    for isa in _isas(dtype):
        for rows in range(1, 10):
            want = matmul.own_linear(x[:rows], dense.to(dtype), isa=isa)
            want8 = matmul.own_linear(x[:rows], dense8.to(dtype), isa=isa)
            for path in (0, 1, 2):
                got = KERNEL.linear(x[:rows], qs, d, m, isa=isa, path=path)
                assert torch.equal(got, want), (isa, path, rows)
                got8 = KERNEL.linear8(x[:rows], w8, d8, isa=isa, path=path)
                assert torch.equal(got8, want8), (isa, path, rows)


def test_a_wrong_scale_moves_its_column_only() -> None:
    assert KERNEL is not None
    qs, d, m, _ = _q4(4)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(5))
    good = KERNEL.linear(x, qs, d, m)
    bad = d.clone()
    bad[7, -1] *= 1.5  # the last group, in the partial set of 16
    wrong = KERNEL.linear(x, qs, bad, m)
    assert not torch.allclose(wrong[:, 7], good[:, 7], atol=1e-4)
    assert torch.equal(wrong[:, :7], good[:, :7]) and torch.equal(wrong[:, 8:], good[:, 8:])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_invariant_across_counts_offsets_and_threads(
    dtype: torch.dtype, threads: int
) -> None:
    assert KERNEL is not None
    qs, d, m, _ = _q4(6, 96)
    w8, d8, _ = _q8(7, 96)
    x = torch.randn(80, 96, generator=torch.Generator().manual_seed(8)).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.cat([KERNEL.linear(x[i : i + 1], qs, d, m) for i in range(80)])
        one8 = torch.cat([KERNEL.linear8(x[i : i + 1], w8, d8) for i in range(80)])
        torch.set_num_threads(threads)
        for rows in [*range(1, 18), 32, 64]:
            for off in (0, 3, 80 - rows):
                assert torch.equal(KERNEL.linear(x[off : off + rows], qs, d, m), one[off : off + rows]), (
                    rows,
                    off,
                )
                assert torch.equal(KERNEL.linear8(x[off : off + rows], w8, d8), one8[off : off + rows])
    finally:
        torch.set_num_threads(before)


def test_pack_keeps_the_gguf_nibble_order() -> None:
    q = torch.arange(32, dtype=torch.int32).remainder(16).view(1, 32)
    packed = q4.pack(q)
    assert packed.shape == (1, 1, 16)
    assert [int(b) & 15 for b in packed[0, 0]] == list(range(16))
    assert [int(b) >> 4 for b in packed[0, 0]] == list(range(16))


def test_scales_must_be_float16_values() -> None:
    assert torch.equal(q4.halves(torch.tensor([0.5, -0.25])), torch.tensor([0.5, -0.25]).half())
    with pytest.raises(ValueError, match="must be float16 values"):
        q4.halves(torch.tensor([0.1]))  # 0.1 in float32 is not a float16 value
    assert KERNEL is not None
    qs, d, m, _ = _q4(k=32)
    with pytest.raises(TypeError, match="float16 scales"):
        KERNEL.linear(torch.randn(1, 32), qs, d.float(), m)


def test_q4_weights_take_the_kernel_for_decode_rows_and_the_rule_for_prefill_rows(monkeypatch) -> None:
    from prefixcache.engine.gemm import Rows, gemm_rule
    from prefixcache.engine.quant import Q4Weight

    assert KERNEL is not None
    gen = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (N, 576), dtype=torch.int32, generator=gen)
    d = (torch.rand(N, 18, generator=gen) * 0.01).half().float()
    m = (torch.rand(N, 18, generator=gen) * -0.05).half().float()
    x = torch.randn(40, 576, generator=gen).bfloat16()
    rule = gemm_rule(torch.bfloat16, torch.device("cpu"))
    monkeypatch.delenv("PREFIXCACHE_Q4", raising=False)
    own = Q4Weight(q, d, m, torch.bfloat16, rule.own or None)
    assert own.own is not None and own.any_rows and own.desc is not None
    calls: list[int] = []
    real = KERNEL.linear
    monkeypatch.setattr(KERNEL, "linear", lambda a, *w, **kw: calls.append(a.shape[0]) or real(a, *w, **kw))
    got = rule.linear(x, own, None, Rows(40, ((0, 40, True),)))
    assert calls == [40]  # past the decode piece (32), still one call: rows invariant at any count
    mixed = rule.linear(x, own, None, Rows(40, ((0, 30, False), (30, 40, True))))
    assert torch.equal(mixed[30:], got[30:])
    prefill = rule.linear(x[:30], own.dense, None, Rows(30, ((0, 30, False),)))
    assert torch.equal(mixed[:30], prefill)  # prefill rows: the rule on the dequantized weights
    if rule.own and rule.own != "amx":  # decode rows: the own GEMM's bits on them
        assert torch.equal(got, rule.linear(x, own.dense, None, Rows(40, ((0, 40, True),))))
    monkeypatch.setenv("PREFIXCACHE_Q4", "torch")
    assert Q4Weight(q, d, m, torch.bfloat16).own is None
    monkeypatch.setenv("PREFIXCACHE_Q4", "fast")
    with pytest.raises(ValueError, match="PREFIXCACHE_Q4 must be one of auto, own, torch"):
        Q4Weight(q, d, m, torch.bfloat16)
