"""The 8-bit-activation kernels (``--weights q4a8``, ``kernels/pc_q4.c``'s pc_q4a8_linear and
pc_q8a8_linear): another arithmetic than the float weights', so each output is checked against a
float64 reference of the documented one (rows quantized to 8 bits a group of 32, integer group
dot products) within a tight tolerance and against the float product within the quantization's;
the AVX512-VNNI, AVX2 and scalar paths give the same bits at every tile shape; a row's bits do
not depend on the row count, its offset or the thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache.engine.kernels import q4

KERNEL = q4.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the native kernels are not built here")
DTYPES = [torch.float32, torch.bfloat16]


def _q4(seed: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the ints 0..15 [n, k], float16 d, float16 m, the dequantized float32 weights)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    m = (-8 * d.float() + torch.randn(n, k // 32, generator=gen) * 0.001).half()
    d[0, 0], m[1, 0] = 0.0, -0.0
    dense = (q.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None]).view(n, k)
    return q, d, m, dense


def _q8(seed: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (n, k // 32, 32), dtype=torch.int8, generator=gen)
    w[0, 0] = -128  # the one value whose magnitude is 128
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    return w, d, (w.float() * d.float()[..., None]).view(n, k)


def _rows8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented row quantization in float32 arithmetic: (ints [R, K], scales a [R, K/32])."""
    g = x.float().view(x.shape[0], -1, 32)
    a = g.abs().amax(-1) / 127.0
    inv = torch.where(a > 0, 1.0 / a, torch.zeros_like(a))
    ints = torch.round(g * inv[..., None]).clamp(-127, 127)  # torch.round: half to even
    return ints.view(x.shape), a


def _reference4(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    ints, a = _rows8(x)
    r, k = ints.shape
    dots = torch.einsum("rgi,ngi->rng", ints.double().view(r, -1, 32), q.double().view(q.shape[0], -1, 32))
    s = (a * ints.view(r, -1, 32).sum(-1)).double()  # a * the group's integer sum (float32 product)
    return (dots * (d.double()[None] * a.double()[:, None]) + m.double()[None] * s[:, None]).sum(-1)


def _reference8(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    ints, a = _rows8(x)
    r = ints.shape[0]
    dots = torch.einsum("rgi,ngi->rng", ints.double().view(r, -1, 32), w.double())
    return (dots * (d.double()[None] * a.double()[:, None])).sum(-1)


@pytest.mark.parametrize("k", [576, 1536, 96, 416, 32, 2080, 32800], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_outputs_follow_the_8_bit_rows_arithmetic_on_every_path(dtype: torch.dtype, k: int) -> None:
    """K: whole and partial sets of eight groups, an odd group count (the last record half
    empty), 13 groups (eight, four and one: each part of the mins' four-column loop), one group,
    65 groups, and 1,025 (past the AVX2 tiles' 1,024: the scalar path).
    N = 54: 13 quads of columns (their records interleaved), then two lone columns."""
    assert KERNEL is not None
    q, d, m, dense = _q4(1, k, 54)
    w8, d8, dense8 = _q8(2, k, 54)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    qs, p8 = q4.pack_pairs(q), q4.interleave_quads(w8)
    got = KERNEL.linear_a8(x, qs, d, m)
    got8 = KERNEL.linear8_a8(x, p8, d8)
    assert got.dtype == got8.dtype == dtype
    for path in (1, 2):  # AVX2, scalar: the best path's bits (AVX512-VNNI's where it runs)
        assert torch.equal(KERNEL.linear_a8(x, qs, d, m, path=path), got), path
        assert torch.equal(KERNEL.linear8_a8(x, p8, d8, path=path), got8), path
    rounding = 0.0 if dtype == torch.float32 else 2.0**-8  # bfloat16 output: half an ulp at most
    for have, want in ((got, _reference4(x, q, d, m)), (got8, _reference8(x, w8, d8))):
        bound = 1e-5 * want.abs().max() + rounding * want.abs()  # float32 sums of the exact terms
        assert ((have.double() - want).abs() <= bound).all()
    # and, 8-bit rows being another model numerically, near the float product only
    exact = x.double() @ dense.double().T
    assert torch.allclose(got.double(), exact, rtol=5e-2, atol=5e-2 * exact.abs().max())
    assert not torch.equal(got, (x.float() @ dense.T).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_every_tile_shape_gives_the_scalar_paths_bits(dtype: torch.dtype) -> None:
    """Row counts 1-9 (tiles of two rows and a lone one) against N = 211 (52 quads of columns,
    then 3 lone columns), K with an odd group count."""
    assert KERNEL is not None
    q, d, m, _ = _q4(10, 96, 211)
    w8, d8, _ = _q8(11, 96, 211)
    qs, w8 = q4.pack_pairs(q), q4.interleave_quads(w8)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(12)).to(dtype)
    for rows in range(1, 10):
        xs = x[:rows]
        want, want8 = KERNEL.linear_a8(xs, qs, d, m, path=2), KERNEL.linear8_a8(xs, w8, d8, path=2)
        for path in (0, 1):  # the best tiles (AVX512-VNNI's where the CPU has it), AVX2's
            assert torch.equal(KERNEL.linear_a8(xs, qs, d, m, path=path), want), (rows, path)
            assert torch.equal(KERNEL.linear8_a8(xs, w8, d8, path=path), want8), (rows, path)


def test_the_best_path_takes_avx512_vnni_where_the_cpu_has_it() -> None:
    """An AVX512 build on a CPU with AVX512-VNNI runs the tiles with its dot product (the tests
    above then pin its bits to the AVX2 and scalar paths'); elsewhere the AVX2 tiles."""
    assert KERNEL is not None
    flags = set(Path("/proc/cpuinfo").read_text().split())
    vnni = KERNEL.paths[0] == "avx512" and {"avx512_vnni", "avx512vl"} <= flags
    best = "avx512vnni" if vnni else KERNEL.paths[1]
    assert KERNEL.paths_a8 == {0: best, 1: KERNEL.paths[1], 2: "scalar"}


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_invariant_across_counts_offsets_and_threads(
    dtype: torch.dtype, threads: int
) -> None:
    assert KERNEL is not None
    q, d, m, _ = _q4(4, 576, 64)
    w8, d8, _ = _q8(5, 576, 64)
    qs, w8 = q4.pack_pairs(q), q4.interleave_quads(w8)
    x = torch.randn(600, 576, generator=torch.Generator().manual_seed(6)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = torch.cat([KERNEL.linear_a8(x[i : i + 1], qs, d, m) for i in range(70)])
        one8 = torch.cat([KERNEL.linear8_a8(x[i : i + 1], w8, d8) for i in range(70)])
        for rows in [*range(1, 18), 32, 64, 512]:
            for off in (0, 5):
                k = min(rows, 70 - off)
                got = KERNEL.linear_a8(x[off : off + rows], qs, d, m)
                assert torch.equal(got[:k], one[off : off + k]), (rows, off)
                got8 = KERNEL.linear8_a8(x[off : off + rows], w8, d8)
                assert torch.equal(got8[:k], one8[off : off + k]), (rows, off)
    finally:
        torch.set_num_threads(before)


def test_a_row_is_quantized_alone() -> None:
    """A row's 8-bit groups come from that row only: scaling another row of the call by 1,000
    changes nothing in this one, and scaling a row's own group moves only that row."""
    assert KERNEL is not None
    q, d, m, _ = _q4(7, 64, 8)
    qs = q4.pack_pairs(q)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    base = KERNEL.linear_a8(x, qs, d, m)
    y = x.clone()
    y[2] *= 1000
    moved = KERNEL.linear_a8(y, qs, d, m)
    assert torch.equal(moved[:2], base[:2]) and not torch.equal(moved[2], base[2])


def test_pack_pairs_puts_two_groups_in_a_record() -> None:
    q = torch.arange(3 * 32, dtype=torch.int32).remainder(16).view(1, 96)  # three groups
    q[0, 32:64] = 15 - q[0, 32:64]
    rec = q4.pack_pairs(q)
    assert rec.shape == (1, 2, 32) and rec.dtype == torch.uint8
    assert torch.equal(rec[0, 0] & 15, q[0, :32].to(torch.uint8))
    assert torch.equal(rec[0, 0] >> 4, q[0, 32:64].to(torch.uint8))
    assert torch.equal(rec[0, 1] & 15, q[0, 64:].to(torch.uint8))
    assert int((rec[0, 1] >> 4).sum()) == 0  # the odd last group's record: high nibbles empty


def test_whole_quads_of_columns_interleave_their_records() -> None:
    """Record r of column 4j + c at quad j's start + 4 r + c records; the last N mod 4 columns
    as they are. Both formats (pack_pairs' Q4_1 records, Q8_0's groups)."""
    n, r = 7, 3
    rec = torch.arange(n * r * 32, dtype=torch.int32).remainder(127).to(torch.int8).view(n, r, 32)
    got = q4.interleave_quads(rec)
    assert got.shape == rec.shape
    flat = got.view(-1, 32)
    for col in range(4):
        for i in range(r):
            assert torch.equal(flat[4 * i + col], rec[col, i]), (col, i)
    assert torch.equal(got[4:], rec[4:])  # the three lone columns
    q = torch.randint(0, 16, (5, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    pairs = q4.pack_pairs(q).view(-1, 32)
    one = q4.pack_pairs(q[2:3])[0]  # column 2's records alone (a lone column: as they are)
    assert torch.equal(pairs[2], one[0]) and torch.equal(pairs[4 + 2], one[1])


def test_misshapen_records_are_refused() -> None:
    assert KERNEL is not None
    q, d, m, _ = _q4(9, 96, 4)
    x = torch.randn(1, 96)
    with pytest.raises(ValueError, match="records"):
        KERNEL.linear_a8(x, q4.pack(q), d, m)  # the GGUF's layout, not the two-group records
    with pytest.raises(TypeError, match="float16"):
        KERNEL.linear_a8(x, q4.pack_pairs(q), d.float(), m)
