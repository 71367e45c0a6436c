"""4-bit weights (``weights="q4"``, ``engine/quant.py``): torch's int4 kernel (the fallback) computes
the Q4_1 groups' product with invariant rows (row counts 1-17, 32, 64, 512); an engine on 4-bit
weights is exact (cache on == off, batched == alone), lives in its own cache namespace and, on the
own quantized kernels, gives the float weights' tokens."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_invariance import _check_invariance

from prefixcache.engine.engine import Engine
from prefixcache.engine.gemm import Rows, gemm_rule
from prefixcache.engine.kernels import q4 as q4_kernel
from prefixcache.engine.llama import LlamaRunner
from prefixcache.engine.quant import GROUP, Q4Weight, Q8Weight


def _random_q4(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> Q4Weight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    d = (torch.rand(n, k // GROUP, generator=gen) * 0.01).half().float()  # float16 values, as in a GGUF
    m = (-8 * d + torch.randn(n, k // GROUP, generator=gen) * 0.001).half().float()
    return Q4Weight(q, d, m, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_int4_kernel_computes_the_groups_product_with_invariant_rows(
    dtype: torch.dtype, monkeypatch
) -> None:
    monkeypatch.setenv("PREFIXCACHE_Q4", "torch")  # the fallback (the own kernel: test_q4_kernel.py)
    w = _random_q4(960, 576, dtype)
    assert w.own is None
    x = torch.randn(600, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    rule = gemm_rule(dtype, torch.device("cpu"))
    one = torch.cat([rule.linear(x[i : i + 1], w, None, Rows(1, ((0, 1, True),))) for i in range(40)])
    for m in [*range(1, 18), 32, 64, 512]:
        for off in (0, 5):
            got = rule.linear(x[off : off + m], w, None, Rows(m, ((0, m, True),)))
            k = min(m, 40 - off)
            assert torch.equal(got[:k], one[off : off + k]), (m, off)
    want = F.linear(x[:64].float(), w.dense.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(one[:40].float(), want[:40], atol=tol, rtol=tol)


def test_bad_weight_formats_are_refused_with_what_to_pass(tiny_runner) -> None:
    with pytest.raises(ValueError, match="weights must be one of auto, float, q4, q4a8"):
        Engine(tiny_runner, prefill_chunk=16, weights="q8")
    with pytest.raises(ValueError, match="needs a GGUF model with Q4_1 weights"):
        Engine(tiny_runner, prefill_chunk=16, weights="q4")
    with pytest.raises(ValueError, match="needs the own runner"):
        Engine(tiny_runner, prefill_chunk=16, weights="q4", runner="hf")


def _batched_under_a_cached_prompt_equals_alone(engine: Engine, off: Engine) -> tuple[list[Any], list[Any]]:
    """Four chats on one system prompt, sent together to ``engine`` once the prompt's blocks are
    cached, answer what ``off`` (the same weights, cache off) answers each alone, with hits.
    Returns (the chats, the answers alone)."""
    system = "You are a terse assistant for a bicycle shop. Answer in one short sentence. " * 6
    msgs = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}]
        for q in ("Do you fix flat tyres?", "When do you open?", "Do you sell helmets?", "Hi")
    ]
    alone = [off.generate(messages=m, max_tokens=12) for m in msgs]
    engine.generate(messages=msgs[0], max_tokens=1)  # the system prompt's blocks are now cached
    got: dict[int, Any] = {}

    def ask(i: int) -> None:
        got[i] = engine.generate(messages=msgs[i], max_tokens=12)

    workers = [threading.Thread(target=ask, args=(i,)) for i in range(len(msgs))]
    for t in workers:
        t.start()
    for t in workers:
        t.join(300)
    for i, ref in enumerate(alone):
        assert got[i].tokens == ref.tokens, i
        assert got[i].usage.cached_tokens > 0
    return msgs, alone


@pytest.mark.model
@pytest.mark.parametrize("kernel", ["torch", "own"])
def test_q4_smollm2_is_exact_invariant_and_in_its_own_namespace(real_runner, kernel, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_Q4", kernel)  # torch's int4 kernel, or the own pc_q4.c
    q4 = Engine(real_runner, weights="q4")
    plain = Engine(real_runner)
    off = Engine(real_runner, weights="q4", enable_cache=False)
    try:
        assert isinstance(q4.runner, LlamaRunner) and q4.runner.weights_format == "q4_1"
        own = kernel == "own" and q4_kernel.load() is not None
        exact = own and q4.runner.gemm.own not in ("", "amx")
        assert q4.runner.weights_exact == exact
        # the float model's bits share its blocks; another arithmetic (torch's int4) never does
        assert (q4.fingerprint == plain.fingerprint) == exact
        assert ("q4_1-int4pack" in q4.runner.weights_id) == (not own)
        assert isinstance(q4.runner.lm_head, Q8Weight) == own  # the lm_head in the file's Q8_0 groups
        assert _check_invariance(q4.runner, 611, 1) == []
        msgs, alone = _batched_under_a_cached_prompt_equals_alone(q4, off)
        shared = plain.generate(messages=msgs[0], max_tokens=1).usage.cached_tokens
        assert shared == 0  # each engine has its own cache; a namespace is what a shared tier keys on
        if exact:  # the quantized kernels compute the float model's bits
            floats = [plain.generate(messages=m, max_tokens=12).tokens for m in msgs]
            assert floats == [r.tokens for r in alone]  # type: ignore[attr-defined]
    finally:
        for e in (q4, plain, off):
            e.close()


@pytest.mark.model
def test_q4a8_smollm2_is_exact_invariant_and_in_its_own_namespace(real_runner, monkeypatch) -> None:
    """``--weights q4a8`` (decode and logits rows in 8 bits a group): another model numerically,
    so its own namespace; exact in itself (rows invariant at every count, batched under a cached
    system prompt equals alone with the cache off). How close it stays to the float weights is
    bench_quality.py's figure, not a test's: a greedy token flips where two logits are within the
    8-bit rows' error."""
    monkeypatch.delenv("PREFIXCACHE_Q4", raising=False)
    if q4_kernel.load() is None:
        with pytest.raises(ValueError, match="q4a8 needs the own quantized kernels"):
            Engine(real_runner, weights="q4a8")
        return
    a8 = Engine(real_runner, weights="q4a8")
    q4 = Engine(real_runner, weights="q4")
    off = Engine(real_runner, weights="q4a8", enable_cache=False)
    try:
        assert isinstance(a8.runner, LlamaRunner) and a8.runner.weights_format == "q4_1a8"
        assert not a8.runner.weights_exact and "q4_1a8-pcq4a8-v" in a8.runner.weights_id
        assert a8.fingerprint != q4.fingerprint
        assert isinstance(a8.runner.lm_head, Q8Weight) and a8.runner.lm_head.a8
        assert all(a8.runner.layers[0][n].a8 for n in ("qkv", "o", "gu", "down"))
        assert _check_invariance(a8.runner, 611, 1) == []
        _batched_under_a_cached_prompt_equals_alone(a8, off)
    finally:
        for e in (a8, q4, off):
            e.close()


def test_q4a8_without_the_own_kernels_says_what_to_use(tiny_runner, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_Q4", "torch")
    with pytest.raises(ValueError, match="q4a8 needs the own quantized kernels.*use --weights q4 or float"):
        Q4Weight(
            torch.zeros(4, 32, dtype=torch.int32),
            torch.zeros(4, 1),
            torch.zeros(4, 1),
            torch.float32,
            a8=True,
        )


def test_auto_keeps_the_float_weights_without_a_q4_gguf(tiny_runner) -> None:
    e = Engine(tiny_runner, prefill_chunk=16)  # weights="auto", the default
    try:
        assert getattr(e.runner, "weights_format", None) is None  # the tiny model has no GGUF
    finally:
        e.close()


@pytest.mark.model
def test_auto_reads_the_4_bit_groups_where_they_give_the_float_bits(real_runner, monkeypatch) -> None:
    monkeypatch.delenv("PREFIXCACHE_Q4", raising=False)
    auto, plain = Engine(real_runner), Engine(real_runner, weights="float")
    try:
        exact = q4_kernel.load() is not None and plain.runner.gemm.own not in ("", "amx")
        assert (getattr(auto.runner, "weights_format", None) == "q4_1") == exact
        assert auto.fingerprint == plain.fingerprint  # either way: the float model's namespace
        msgs = [{"role": "user", "content": "Name three colours."}]
        assert (
            auto.generate(messages=msgs, max_tokens=8).tokens
            == plain.generate(messages=msgs, max_tokens=8).tokens
        )
    finally:
        auto.close()
        plain.close()
    monkeypatch.setenv("PREFIXCACHE_Q4", "torch")  # torch's int4 kernel is another arithmetic: auto says no
    torch_auto = Engine(real_runner)
    try:
        assert getattr(torch_auto.runner, "weights_format", None) is None
    finally:
        torch_auto.close()
