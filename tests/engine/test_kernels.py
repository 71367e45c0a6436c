"""The own CPU kernels (pc_kernels.c), one by one: against a float64 torch reference within a
tolerance (a consistently wrong kernel fails), and row invariance: a row's output computed alone
equals, bitwise, the same row computed among 1-17, 32, 64 or 512 rows, at other offsets, batched
with other sequences, and with 1 or 2 threads (the kernel's own count and torch's)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from prefixcache.engine import kernels
from prefixcache.engine.llama_native import DTYPE_CODES

DTYPES = [torch.float32, torch.bfloat16]
ROW_COUNTS = [*range(1, 18), 32, 64, 512]
#: Tolerances against the float64 reference: float32 arithmetic, or one bf16 rounding (2^-8).
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def lib() -> object:
    k = kernels.load("native")
    assert k is not None
    return k.lib


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), (err, scale)


# ---------------------------------------------------------------------------------- RMSNorm
def _rms(
    lib: object, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, nt: int = 2
) -> torch.Tensor:
    out = torch.empty_like(x)
    lib.pc_rms_residual(  # type: ignore[attr-defined]
        DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], x.data_ptr(),
        None if delta is None else delta.data_ptr(), w.data_ptr(), 1e-5, out.data_ptr(), nt,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_residual_matches_the_reference(lib: object, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g).to(dtype)
    d = torch.randn(37, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    x0 = x.clone()
    out = _rms(lib, x, d, w)
    s = x0.double() + d.double()
    _close(x, s, dtype)  # the residual stream, updated in place
    want = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    _close(out, want, dtype)
    # without a residual: a plain RMSNorm, x untouched
    y = x0.clone()
    _close(
        _rms(lib, y, None, w),
        w.double() * x0.double() * torch.rsqrt(x0.double().pow(2).mean(-1, keepdim=True) + 1e-5),
        dtype,
    )
    assert torch.equal(y, x0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_rows_do_not_depend_on_the_rows_beside_them(lib: object, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 576, generator=g).to(dtype)
    d = torch.randn(600, 576, generator=g).to(dtype)
    w = torch.rand(576, generator=g).to(dtype)
    xa = x.clone()
    ref = _rms(lib, xa, d, w, nt=1)
    for n in ROW_COUNTS:
        for off, nt in ((0, 2), (3, 1), (80, 2)):
            xs = x[off : off + n].clone()
            assert torch.equal(_rms(lib, xs, d[off : off + n].clone(), w, nt), ref[off : off + n]), (n, off)
            assert torch.equal(xs, xa[off : off + n])


# ---------------------------------------------------------------------------------- SwiGLU
def _swiglu(lib: object, gu: torch.Tensor, nt: int = 2) -> torch.Tensor:
    inter = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], inter, dtype=gu.dtype)
    lib.pc_swiglu(DTYPE_CODES[gu.dtype], gu.shape[0], inter, gu.data_ptr(), out.data_ptr(), nt)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_the_reference_and_is_row_invariant(lib: object, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(520, 2 * 1536, generator=g) * 4).to(dtype)
    gu[0, :8] = torch.tensor([-100.0, -88.0, -87.0, -20.0, 0.0, 20.0, 87.0, 100.0]).to(
        dtype
    )  # exp's range ends
    out = _swiglu(lib, gu)
    gate, up = gu.double().chunk(2, dim=-1)
    _close(out, F.silu(gate) * up, dtype)
    for n in ROW_COUNTS:
        for off, nt in ((0, 1), (5, 2)):
            if off + n <= gu.shape[0]:
                assert torch.equal(_swiglu(lib, gu[off : off + n].clone(), nt), out[off : off + n]), (n, off)


# ---------------------------------------------------------------------------------- RoPE + KV write
def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_writes_rotated_keys_and_values_into_their_slots(lib: object, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    H, KV, D, B, blocks, rows = 9, 3, 64, 16, 12, 21
    qkv = torch.randn(rows, (H + 2 * KV) * D, generator=g).to(dtype)
    ang = torch.rand(300, D // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    pos = torch.randperm(300, generator=g)[:rows].long()
    slots = torch.randperm(blocks * B, generator=g)[:rows].long()
    pool = torch.zeros(2, KV, blocks, B, D, dtype=dtype)
    q = torch.empty(rows, H, D)
    lib.pc_rope_kv(  # type: ignore[attr-defined]
        DTYPE_CODES[dtype], rows, H, KV, D, qkv.data_ptr(), pos.data_ptr(), slots.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), 0.125, q.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(),
        blocks * B * D, 2,
    )  # fmt: skip
    x = qkv.double().view(rows, H + 2 * KV, D)
    c, s = cos.double()[pos][:, None], sin.double()[pos][:, None]
    _close(q, _rope_ref(x[:, :H], c, s) * 0.125, torch.float32 if dtype == torch.float32 else dtype)
    keys = pool[0].view(KV, blocks * B, D)[:, slots].transpose(0, 1)
    values = pool[1].view(KV, blocks * B, D)[:, slots].transpose(0, 1)
    _close(keys, _rope_ref(x[:, H : H + KV], c, s), dtype)
    assert torch.equal(values, qkv.view(rows, H + 2 * KV, D)[:, H + KV :])
    written = torch.zeros(blocks * B, dtype=torch.bool)
    written[slots] = True
    assert not pool[:, :, :, :].reshape(2, KV, blocks * B, D)[:, :, ~written].any()  # nothing else touched


# ---------------------------------------------------------------------------------- attention
class _Paged:
    """A random pool layer [KV, blocks, B, D] holding one sequence of ``length`` positions through
    a shuffled block table, and float32 queries for every position (scaled)."""

    def __init__(
        self, dtype: torch.dtype, length: int, H: int = 9, KV: int = 3, D: int = 64, seed: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.H, self.KV, self.D, self.B, self.dtype = H, KV, D, 16, dtype
        nb = -(-length // self.B)
        self.blocks = nb + 3
        self.keys = torch.randn(KV, self.blocks, self.B, D, generator=g).to(dtype)
        self.values = torch.randn(KV, self.blocks, self.B, D, generator=g).to(dtype)
        self.table = (torch.randperm(self.blocks - 1, generator=g)[:nb] + 1).to(torch.int32)
        self.q = torch.randn(length, H, D, generator=g) * D**-0.5 * 3

    def run(
        self, lib: object, segs: list[tuple[int, int]], nt: int = 2, decode: bool | list[bool] = False
    ) -> torch.Tensor:
        """Segments (start, rows) of this sequence, each its own segment of one call (prompt rows,
        or decode rows: ``decode`` for all of them or one flag per segment); the outputs' rows in
        call order."""
        flags = decode if isinstance(decode, list) else [decode] * len(segs)
        qs = torch.cat([self.q[s : s + n] for s, n in segs]).contiguous()
        seg, row = [], 0
        for (s, n), d in zip(segs, flags, strict=True):
            seg.extend((row, n, s, 0, int(d)))
            row += n
        seg_t = torch.tensor(seg, dtype=torch.long)
        out = torch.empty(row, self.H, self.D, dtype=self.dtype)
        lib.pc_attention(  # type: ignore[attr-defined]
            DTYPE_CODES[self.dtype], self.H, self.KV, self.D, qs.data_ptr(), self.keys.data_ptr(),
            self.values.data_ptr(), self.blocks * self.B * self.D, self.B, len(segs), seg_t.data_ptr(),
            self.table.data_ptr(), out.data_ptr(), nt,
        )  # fmt: skip
        return out

    def reference(self, start: int, n: int) -> torch.Tensor:
        """float64 causal attention of positions [start, start + n)."""
        G = self.H // self.KV
        flat = lambda t: t[:, self.table.long()].reshape(self.KV, -1, self.D).double()  # noqa: E731
        k, v = flat(self.keys), flat(self.values)
        out = torch.empty(n, self.H, self.D, dtype=torch.float64)
        for i in range(n):
            p = start + i
            for h in range(self.H):
                s = k[h // G, : p + 1] @ self.q[p, h].double()
                out[i, h] = torch.softmax(s, 0) @ v[h // G, : p + 1]
        return out


PATHS = [False, True]  # prompt rows, decode rows: two arithmetics (pc_kernels.c)


@pytest.mark.parametrize("decode", PATHS, ids=["prompt", "decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_the_reference(lib: object, dtype: torch.dtype, decode: bool) -> None:
    pg = _Paged(dtype, 300, seed=4)
    for start, n in [(0, 1), (0, 20), (150, 33), (299, 1), (17, 5), (40, 100)]:
        _close(pg.run(lib, [(start, n)], decode=decode), pg.reference(start, n), dtype)
    # tiny-model shapes (head_dim 16, two query heads per KV head) take another code path
    small = _Paged(dtype, 90, H=4, KV=2, D=16, seed=5)
    _close(small.run(lib, [(40, 50)], decode=decode), small.reference(40, 50), dtype)
    odd = _Paged(dtype, 70, H=5, KV=1, D=32, seed=6)  # the generic path (one query at a time)
    _close(odd.run(lib, [(10, 60)], decode=decode), odd.reference(10, 60), dtype)
    wide = _Paged(dtype, 40, H=4, KV=2, D=128, seed=10)
    _close(wide.run(lib, [(3, 37)], decode=decode), wide.reference(3, 37), dtype)


@pytest.mark.parametrize("decode", PATHS + ["rows"], ids=["prompt", "decode", "decode-rows"])
def test_attention_does_not_read_keys_past_a_rows_position(lib: object, decode: bool | str) -> None:
    """Poisoned (NaN) keys and values past the last row change nothing: for a chunk of prompt or
    decode rows, and for one-row decode segments on one table (grouped: a shared tile is read
    through the row that sees the most of it, the others' masked lanes replaced)."""
    pg = _Paged(torch.float32, 200, seed=7)
    segs = [(p, 1) for p in range(100, 121)] if decode == "rows" else [(100, 21)]
    decode = bool(decode)
    before = pg.run(lib, segs, decode=decode)
    flat_k = pg.keys.view(pg.KV, -1, pg.D)
    flat_v = pg.values.view(pg.KV, -1, pg.D)
    for p in range(121, 200):
        slot = int(pg.table[p // 16]) * 16 + p % 16
        flat_k[:, slot] = float("nan")
        flat_v[:, slot] = float("nan")
    assert torch.equal(pg.run(lib, segs, decode=decode), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_are_invariant(lib: object, dtype: torch.dtype) -> None:
    """Every prompt row of every chunk equals that row computed alone (a one-row segment), and
    every decode row its decode row alone, for the row counts, offsets, batch mates and thread
    counts of the module doc."""
    length = 700
    pg = _Paged(dtype, length, seed=8)
    alone = torch.cat([pg.run(lib, [(p, 1)], nt=1) for p in range(length)])
    alone_decode = torch.cat([pg.run(lib, [(p, 1)], nt=1, decode=True) for p in range(length)])
    rng = random.Random(0)
    threads = torch.get_num_threads()
    try:
        for n in ROW_COUNTS:
            for nt in (1, 2):
                torch.set_num_threads(nt)
                start = rng.randrange(0, length - n + 1)
                got = pg.run(lib, [(start, n)], nt=nt)
                assert torch.equal(got, alone[start : start + n]), (n, start, nt)
                got = pg.run(lib, [(start, n)], nt=nt, decode=True)
                assert torch.equal(got, alone_decode[start : start + n]), (n, start, nt)
        # batched: decode rows and prompt chunks of the same sequence in one call
        segs = [(5, 1), (640, 1), (100, 64), (699, 1), (16, 17), (300, 1)]
        flags = [True, True, False, True, False, False]
        got = pg.run(lib, segs, nt=2, decode=flags)
        want = torch.cat(
            [(alone_decode if d else alone)[s : s + n] for (s, n), d in zip(segs, flags, strict=True)]
        )
        assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_sharing_blocks_give_the_bits_they_give_alone(lib: object, dtype: torch.dtype) -> None:
    """Decode rows on one cached prefix read each shared tile once (the kernel groups them by
    block table): rows sharing all, part or none of their blocks, at positions before, inside and
    past the shared part, in any order in the step, equal the same rows computed alone."""
    g = torch.Generator().manual_seed(12)
    H, KV, D, B, blocks = 9, 3, 64, 16, 200
    keys = torch.randn(KV, blocks, B, D, generator=g).to(dtype)
    values = torch.randn(KV, blocks, B, D, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    base, other, third = perm[:40], perm[40:80], perm[80:120]
    seqs = [
        base,
        base[:20] + other[:20],
        base,
        base[:3] + third[:37],
        other,
        base[:20] + other[:5] + third[:15],
    ]
    positions = [639, 500, 317, 630, 200, 399, 16, 15, 0, 320, 321, 47]
    rows = [(positions[i], seqs[i % len(seqs)]) for i in range(len(positions))]
    q = torch.randn(len(rows), H, D, generator=g) * D**-0.5 * 3

    def call(which: list[int]) -> torch.Tensor:
        seg: list[int] = []
        table: list[int] = []
        for r, i in enumerate(which):
            pos, blocks_of = rows[i]
            seg.extend((r, 1, pos, len(table), 1))
            table.extend(blocks_of[: pos // B + 1])
        qs = q[which].contiguous()
        out = torch.empty(len(which), H, D, dtype=dtype)
        seg_t, table_t = torch.tensor(seg, dtype=torch.long), torch.tensor(table, dtype=torch.int32)
        lib.pc_attention(  # type: ignore[attr-defined]
            DTYPE_CODES[dtype], H, KV, D, qs.data_ptr(), keys.data_ptr(), values.data_ptr(),
            blocks * B * D, B, len(which), seg_t.data_ptr(), table_t.data_ptr(), out.data_ptr(), 2,
        )  # fmt: skip
        return out

    alone = torch.cat([call([i]) for i in range(len(rows))])
    order = list(range(len(rows)))
    for shuffle_seed in range(4):
        random.Random(shuffle_seed).shuffle(order)
        assert torch.equal(call(order), alone[order]), order
    assert torch.equal(call([0, 2]), alone[[0, 2]])  # one prefix, a shorter row sorted first


def test_the_two_paths_are_two_arithmetics(lib: object) -> None:
    """Prompt and decode rows agree within rounding; on AVX512 builds in float32 they are two
    arithmetics (each invariant on its own: a decode row's KV is never cached), on AVX2 builds
    decode rows take the prompt path (the only one with native 256-bit code there), so the same
    bits."""
    pg = _Paged(torch.float32, 300, seed=11)
    prompt, decode = pg.run(lib, [(0, 300)]), pg.run(lib, [(0, 300)], decode=True)
    # one-row decode segments, as a step's decode rows come (grouped by block table)
    rows = pg.run(lib, [(p, 1) for p in range(0, 300, 7)], decode=True)
    _close(prompt, decode, torch.float32)
    if lib.pc_isa().decode() == "avx2":  # type: ignore[attr-defined]
        assert torch.equal(prompt, decode)
        assert torch.equal(rows, prompt[0:300:7])
    else:
        assert not torch.equal(prompt, decode)
        assert torch.equal(rows, decode[0:300:7])


def test_a_prompt_split_at_every_block_gives_the_same_rows(lib: object) -> None:
    pg = _Paged(torch.bfloat16, 400, seed=9)
    whole = pg.run(lib, [(0, 400)])
    for cut in range(16, 400, 16):
        parts = torch.cat([pg.run(lib, [(0, cut)]), pg.run(lib, [(cut, 400 - cut)])])
        assert torch.equal(parts, whole), cut
    for cut in (1, 7, 23, 399):  # chunks need not end on a block
        parts = torch.cat([pg.run(lib, [(0, cut)]), pg.run(lib, [(cut, 400 - cut)])])
        assert torch.equal(parts, whole), cut


# ---------------------------------------------------------------------------------- loader
def test_describe_names_the_kernel_set() -> None:
    k = kernels.load("native")
    assert k is not None
    assert kernels.describe("native").startswith(f"native {k.isa} (")
    assert k.id.startswith(f"native-v{k.version}-{k.isa}-")
    assert kernels.describe("torch").startswith("torch (")
    assert kernels.load("torch") is None
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.resolve("fast")
