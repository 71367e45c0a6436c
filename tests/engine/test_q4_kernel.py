"""The own 4-bit GEMM (``kernels/pc_q4.c``): exactly the product of the 8-bit quantized rows with
the 4-bit groups (a corrupted scale fails), close to the float product, every row bitwise the
same for row counts 1-17, 32, 64 at offsets, on 1 and 2 threads, from float32 and bfloat16 rows,
for K with and without a partial chunk, and the AVX512, AVX2 and scalar paths give the same bits."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.kernels import q4

KERNEL = q4.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the native kernels are not built here")
N = 208


def _weights(seed: int = 0, k: int = 576) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q in 0..15, float16 d and m (some subnormal, some zero), as a GGUF holds them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, k), dtype=torch.int32, generator=gen)
    d = (torch.rand(N, k // 32, generator=gen) * 0.01).half()
    m = (-8 * d.float() + torch.randn(N, k // 32, generator=gen) * 0.001).half()
    d[0, 0], d[1, 0], d[2, 0] = 1e-7, 3e-6, 0.0  # float16 subnormals and a zero
    m[3, 0], m[4, 0] = -2e-7, -0.0
    return q, q4.pack(q), d, m


def _quantized_product(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: rows quantized per group of 32 to nearest-even int8 of
    x * 127 / max |x|, the exact integer dot with q, scaled by d * max |x| / 127, plus m * sum(x)."""
    rows, k = x.shape
    xg = x.float().view(rows, k // 32, 32)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).double()  # torch.round: half to even
    isum = torch.einsum("rgi,ngi->rng", xq, q.view(q.shape[0], -1, 32).double())
    scale = d.double()[None] * (amax / 127.0).double()[:, None]
    return (isum * scale).sum(-1) + (m.double()[None] * xg.double().sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("k", [576, 1536, 96, 32], ids=lambda k: f"K{k}")
def test_the_kernel_computes_the_quantized_rows_product_and_a_wrong_scale_fails(k: int) -> None:
    assert KERNEL is not None
    q, qs, d, m = _weights(k=k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    want = _quantized_product(x, q, d, m)
    got = KERNEL.linear(x, qs, d, m).double()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    dense = (q.double().view(N, -1, 32) * d.double()[..., None] + m.double()[..., None]).view(N, k)
    exact = x.double() @ dense.T  # 8-bit rows: within 3% of the outputs' scale of the float product
    assert (got - exact).abs().max() < 0.03 * exact.abs().max()
    bad = d.clone()
    bad[7, -1] *= 1.5  # one group's scale wrong: its output column must move past the tolerance
    wrong = KERNEL.linear(x, qs, bad, m).double()
    assert not torch.allclose(wrong[:, 7], want[:, 7], atol=1e-5, rtol=1e-5)
    assert torch.allclose(wrong[:, :7], want[:, :7], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [576, 96], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_invariant_across_counts_offsets_threads_and_paths(
    dtype: torch.dtype, threads: int, k: int
) -> None:
    assert KERNEL is not None
    _, qs, d, m = _weights(2, k)
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[5] = 0  # an all-zero row (every group's max is 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.cat([KERNEL.linear(x[i : i + 1], qs, d, m, path=0) for i in range(80)])
        torch.set_num_threads(threads)
        assert one.dtype == dtype
        for rows in [*range(1, 18), 32, 64]:
            for off in (0, 3, 80 - rows):
                got = KERNEL.linear(x[off : off + rows], qs, d, m)
                assert torch.equal(got, one[off : off + rows]), (rows, off)
        for path in (1, 2):  # AVX2 and scalar: the same bits as the best path
            assert torch.equal(KERNEL.linear(x[:17], qs, d, m, path=path), one[:17]), path
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
    _, qs, d, m = _weights(k=32)
    with pytest.raises(TypeError, match="float16 scales"):
        KERNEL.linear(torch.randn(1, 32), qs, d.float(), m)


def test_q4_weights_run_decode_rows_through_the_own_kernel_by_default(monkeypatch) -> None:
    from prefixcache.engine.gemm import Rows, gemm_rule
    from prefixcache.engine.quant import Q4Weight

    assert KERNEL is not None
    q, qs, d, m = _weights(4)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    rule = gemm_rule(torch.bfloat16, torch.device("cpu"))
    monkeypatch.delenv("PREFIXCACHE_Q4", raising=False)
    own = Q4Weight(q, d.float(), m.float(), torch.bfloat16)
    assert own.own is not None and own.any_rows and own.desc is not None
    calls: list[int] = []
    real = KERNEL.linear
    monkeypatch.setattr(KERNEL, "linear", lambda a, *w: calls.append(a.shape[0]) or real(a, *w))
    got = rule.linear(x, own, None, Rows(40, ((0, 40, True),)))
    assert torch.equal(got, real(x, qs, d, m))
    assert calls == [40]  # past the decode piece (32), still one call: rows invariant at any count
    mixed = rule.linear(x, own, None, Rows(40, ((0, 30, False), (30, 40, True))))
    assert torch.equal(mixed[30:], got[30:])  # prefill rows take the dequantized weights
    assert torch.equal(mixed[:30], torch.nn.functional.linear(x[:30], own.dense))
    monkeypatch.setenv("PREFIXCACHE_Q4", "torch")
    assert Q4Weight(q, d.float(), m.float(), torch.bfloat16).own is None
    monkeypatch.setenv("PREFIXCACHE_Q4", "fast")
    with pytest.raises(ValueError, match="PREFIXCACHE_Q4 must be one of auto, own, torch"):
        Q4Weight(q, d.float(), m.float(), torch.bfloat16)


def _q8(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (N, k // 32, 32), dtype=torch.int8, generator=gen)
    w[0, 0] = -128  # |q| = 128: the magnitude trick's edge
    d = (torch.rand(N, k // 32, generator=gen) * 0.01).half()
    d[1, 0] = 1e-7  # a float16 subnormal
    return w, d


@pytest.mark.parametrize("k", [576, 96, 32], ids=lambda k: f"K{k}")
def test_the_q8_kernel_computes_the_quantized_rows_product_and_a_wrong_scale_fails(k: int) -> None:
    assert KERNEL is not None
    w, d = _q8(6, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7))
    xg = x.view(9, k // 32, 32)
    amax = xg.abs().amax(-1)
    xq = torch.round(xg * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))[..., None]).double()
    want = (
        torch.einsum("rgi,ngi->rng", xq, w.double()) * d.double()[None] * (amax / 127).double()[:, None]
    ).sum(-1)
    got = KERNEL.linear8(x, w, d).double()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    exact = x.double() @ (w.double() * d.double()[..., None]).view(N, k).T
    assert (got - exact).abs().max() < 0.03 * exact.abs().max()
    bad = d.clone()
    bad[9, -1] *= 1.5
    wrong = KERNEL.linear8(x, w, bad).double()
    assert not torch.allclose(wrong[:, 9], want[:, 9], atol=1e-5, rtol=1e-5)
    assert torch.allclose(wrong[:, :9], want[:, :9], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [576, 96], ids=lambda k: f"K{k}")  # 96: an odd group count
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_rows_are_bitwise_invariant_across_counts_threads_and_paths(threads: int, k: int) -> None:
    assert KERNEL is not None
    w, d = _q8(8, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.cat([KERNEL.linear8(x[i : i + 1], w, d) for i in range(40)])
        torch.set_num_threads(threads)
        for rows in [*range(1, 18), 32]:
            for off in (0, 40 - rows):
                assert torch.equal(KERNEL.linear8(x[off : off + rows], w, d), one[off : off + rows]), (
                    rows,
                    off,
                )
        for path in (1, 2):
            assert torch.equal(KERNEL.linear8(x[:13], w, d, path=path), one[:13]), path
    finally:
        torch.set_num_threads(before)
