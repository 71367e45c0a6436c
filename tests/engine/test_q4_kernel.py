"""The own 4-bit GEMM (``kernels/pc_q4.c``): close to the dequantized product (a corrupted scale
fails), every row bitwise the same for row counts 1-17, 32, 64 at offsets, on 1 and 2 threads,
from float32 and bfloat16 rows, and the AVX512, AVX2 and scalar paths give the same bits."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.kernels import q4

KERNEL = q4.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the native kernels are not built here")
N, K = 208, 576


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=gen)
    d = torch.rand(N, K // 32, generator=gen) * 0.01
    m = -8 * d + torch.randn(N, K // 32, generator=gen) * 0.001
    return q, q4.pack(q), d, m


def _dense(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (q.double().view(N, -1, 32) * d.double()[..., None] + m.double()[..., None]).view(N, K)


def test_the_kernel_computes_the_dequantized_product_and_a_wrong_scale_fails() -> None:
    assert KERNEL is not None
    q, qs, d, m = _weights()
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1))
    want = x.double() @ _dense(q, d, m).T
    got = KERNEL.linear(x, qs, d, m).double()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    bad = d.clone()
    bad[7, 3] *= 1.5  # one group's scale wrong: its output column must move past the tolerance
    wrong = KERNEL.linear(x, qs, bad, m).double()
    assert not torch.allclose(wrong, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(wrong[:, :7], want[:, :7], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_invariant_across_counts_offsets_threads_and_paths(
    dtype: torch.dtype, threads: int
) -> None:
    assert KERNEL is not None
    _, qs, d, m = _weights(2)
    x = torch.randn(80, K, generator=torch.Generator().manual_seed(3)).to(dtype)
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


def test_q4_weights_run_decode_rows_through_the_own_kernel_when_asked(monkeypatch) -> None:
    from prefixcache.engine.gemm import Rows, gemm_rule
    from prefixcache.engine.quant import Q4Weight

    assert KERNEL is not None
    q, qs, d, m = _weights(4)
    x = torch.randn(12, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    rule = gemm_rule(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv("PREFIXCACHE_Q4", "own")
    own = Q4Weight(q, d, m, torch.bfloat16)
    got = rule.linear(x, own, None, Rows(12, ((0, 12, True),)))
    assert torch.equal(got, KERNEL.linear(x, qs, d, m))
    monkeypatch.setenv("PREFIXCACHE_Q4", "torch")
    assert Q4Weight(q, d, m, torch.bfloat16).own is None
    monkeypatch.setenv("PREFIXCACHE_Q4", "fast")
    with pytest.raises(ValueError, match="PREFIXCACHE_Q4 must be torch or own"):
        Q4Weight(q, d, m, torch.bfloat16)
