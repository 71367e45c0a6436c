"""The GEMM rule behind the own runner's row invariance (``engine/gemm.py``): a row's bits do not
depend on how many rows of its class share the product or where it sits among them, over
SmolLM2's projection shapes and its lm_head, row counts 1-17, 32, 64 and 512 at several offsets,
in float32 and bfloat16, with 1 and 2 threads; and the pieces compute F.linear's product."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from prefixcache.engine.gemm import GemmRule, Rows, gemm_rule
from prefixcache.engine.llama import Segment

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
COUNTS = [*range(1, 18), 32, 64, 512]


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _one_class(n: int, decode: bool) -> Rows:
    return Rows(n, ((0, n, decode),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode rows", "prefill rows"])
def test_rows_are_invariant_to_the_row_count_and_offset(
    dtype: torch.dtype, decode: bool, threads: int
) -> None:
    rule = gemm_rule(dtype, torch.device("cpu"), SHAPES)  # the rule the runner picks on this machine
    gen = torch.Generator().manual_seed(threads)
    for out_f, in_f in SHAPES:
        w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype)
        x = torch.randn(600, in_f, generator=gen).to(dtype)
        ref = torch.cat([rule.linear(x[i : i + 1], w, None, _one_class(1, decode)) for i in range(40)])
        for m in COUNTS:
            for off in (0, 3, 21):
                got = rule.linear(x[off : off + m], w, None, _one_class(m, decode))
                k = min(m, 40 - off)
                assert torch.equal(got[:k], ref[off : off + k]), (out_f, in_f, m, off, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_mixed_step_gives_each_row_its_class_bits(dtype: torch.dtype) -> None:
    """Decode rows then prefill rows (the scheduler's order) and the reverse, with a bias: each
    row equals the same row computed alone in its class."""
    rule = gemm_rule(dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(960, 576, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(960, generator=gen).to(dtype)
    x = torch.randn(3 + 150, 576, generator=gen).to(dtype)
    decode = [Segment([1], 10 + i, [0], decode=True) for i in range(3)]
    prefill = [Segment([1] * 100, 0, [0]), Segment([1] * 50, 0, [0])]
    rows = rule.rows(decode + prefill)
    assert rows.runs == ((0, 3, True), (3, 153, False))
    got = rule.linear(x, w, bias, rows)
    for i in range(3):
        assert torch.equal(got[i], rule.linear(x[i : i + 1], w, bias, _one_class(1, True))[0])
    for i in (3, 77, 152):
        assert torch.equal(got[i], rule.linear(x[i : i + 1], w, bias, _one_class(1, False))[0])
    rev = rule.rows(prefill + decode)
    assert rev.runs == ((0, 150, False), (150, 153, True))
    again = rule.linear(torch.cat([x[3:], x[:3]]), w, bias, rev)
    assert torch.equal(again, torch.cat([got[3:], got[:3]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_pieces_compute_the_same_product_as_f_linear(dtype: torch.dtype) -> None:
    """Not bitwise (other row counts, other kernels), but the same numbers: a wrong rule must not
    pass for being consistently wrong."""
    rule = gemm_rule(dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(576, 1536, generator=gen) * 0.05).to(dtype)
    x = torch.randn(300, 1536, generator=gen).to(dtype)
    for decode in (True, False):
        got = rule.linear(x, w, None, _one_class(300, decode)).float()
        want = F.linear(x.float(), w.float())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(got, want, atol=tol, rtol=tol)


def test_the_rule_is_named_in_the_cache_namespace(tiny_runner) -> None:
    from prefixcache.engine.llama import LlamaRunner

    f32 = LlamaRunner.from_model_runner(tiny_runner, dtype="float32", kernels="torch")
    bf16 = LlamaRunner.from_model_runner(tiny_runner, dtype="bfloat16", kernels="torch")
    assert f32.gemm.tag() == "gemm-p128-d16p"
    assert bf16.gemm.tag() == ("gemm-p128-d32p" if bf16.gemm.pad_decode else "gemm-p128-d32")
    other = copy.copy(f32)
    other.gemm = dataclasses.replace(f32.gemm, prefill_piece=64)
    assert other.fingerprint(16) != f32.fingerprint(16)
    cuda = gemm_rule(torch.float32, torch.device("cuda"))
    assert cuda == GemmRule(0, 0, True, legacy=True) and cuda.padded(5) == 8 and cuda.tag() == "gemm-pad4"


def test_bf16_decode_rows_are_padded_where_the_probe_finds_unpadded_counts_differ(monkeypatch) -> None:
    """On a machine whose bf16 kernels differ below 32 rows, the rule pads decode rows to exactly
    32 (a fixed shape), and its tag (so the cache namespace) says so."""
    import prefixcache.engine.gemm as gemm

    shapes = [(960, 576), (576, 576)]
    monkeypatch.setattr(gemm, "unpadded_rows_invariant", lambda shape, dtype, upto: shape != (576, 576))
    rule = gemm.gemm_rule(torch.bfloat16, torch.device("cpu"), shapes, "torch")
    assert rule.pad_decode and rule.tag() == "gemm-p128-d32p"
    monkeypatch.setattr(gemm, "unpadded_rows_invariant", lambda shape, dtype, upto: True)
    assert not gemm.gemm_rule(torch.bfloat16, torch.device("cpu"), shapes, "torch").pad_decode
