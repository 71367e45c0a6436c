"""The own runner's rows do not depend on the pass that computes them (docs/engine.md).

Each check compares, with ``torch.equal``, logits and pool KV of the same prompt computed in one
pass, in irregular chunks, one row at a time, after a hit at a non-aligned block, and batched
with other requests' prefill and decode rows. A negative control (``attention="sdpa"``, whose split
depends on the query length) shows the same checks catch a non-invariant attention.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.model import ModelRunner


class _Prompt:
    """A prompt with its own blocks in ``pool``."""

    def __init__(self, runner: LlamaRunner, pool: Any, ids: list[int], extra: int = 64) -> None:
        self.ids = ids
        self.blocks = [pool.alloc() for _ in range(-(-(len(ids) + extra) // pool.block_size))]
        self.table = [b.index for b in self.blocks]
        self.pool = pool

    def free(self) -> None:
        """Give the blocks back (the pool frees explicitly, not when a handle is dropped)."""
        self.pool.free_all(self.blocks)
        self.blocks = []


def _run(runner: LlamaRunner, pool: Any, p: _Prompt, cuts: Sequence[int]) -> torch.Tensor:
    """Prefill ``p`` in passes cut at ``cuts``; the last pass's logits."""
    out = None
    bounds = [*cuts, len(p.ids)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out = runner.step(pool, [Segment(p.ids[a:b], a, p.table, want_logits=b == len(p.ids))])
    assert out is not None
    return out[0]


def _kv(pool: Any, p: _Prompt, upto: int) -> torch.Tensor:
    return pool.data[:, :, :, p.table[: upto // pool.block_size]].clone()


def _check_invariance(runner: LlamaRunner, n: int, seed: int) -> list[str]:
    """The names of the checks that found a difference (empty: invariant)."""
    rng = random.Random(seed)
    pool = runner.new_pool(8 * (n // 16 + 8))
    ids = [rng.randrange(0, runner.vocab_size) for _ in range(n)]
    ref = _Prompt(runner, pool, ids)
    one = _run(runner, pool, ref, [0])
    full_kv = _kv(pool, ref, n)
    failed = []
    for name, cuts in [
        ("irregular chunks", [0, 37, 300 % n, (300 % n) + 1, n - 1]),
        ("16-row chunks", list(range(0, n, 16))),
        ("tail of one row", [0, n - 1]),
    ]:
        p = _Prompt(runner, pool, ids)
        cuts = sorted(set(c for c in cuts if 0 <= c < n) | {0})
        if not torch.equal(_run(runner, pool, p, cuts), one) or not torch.equal(_kv(pool, p, n), full_kv):
            failed.append(name)
        p.free()
    # a hit at a block boundary that is not a multiple of anything else: shares ref's blocks
    hit = (n // 3) // 16 * 16
    p = _Prompt(runner, pool, ids)
    p.table[: hit // 16] = ref.table[: hit // 16]
    if not torch.equal(_run(runner, pool, p, [hit]), one):
        failed.append("hit at a block")
    # batched: another prompt's prefill and two decode rows share every pass
    other = _Prompt(runner, pool, [rng.randrange(0, runner.vocab_size) for _ in range(93)])
    runner.step(pool, [Segment(other.ids, 0, other.table, want_logits=True)])
    p = _Prompt(runner, pool, ids)
    got = None
    for step, (a, b) in enumerate([(0, n // 2), (n // 2, n)]):
        segs = [
            Segment([5 + step], 93 + step, other.table, decode=True, want_logits=True),
            Segment(ids[a:b], a, p.table, want_logits=b == n),
        ]
        got = runner.step(pool, segs)
    assert got is not None
    if not torch.equal(got[1], one) or not torch.equal(_kv(pool, p, n), full_kv):
        failed.append("batched prefill")
    # decode: alone, then batched with other decode rows and a prefill
    alone = runner.step(pool, [Segment([9], n, ref.table, decode=True, want_logits=True)])[0]
    mixed = runner.step(
        pool,
        [
            Segment([11], 95, other.table, decode=True, want_logits=True),
            Segment([9], n, p.table, decode=True, want_logits=True),
            Segment(ids[:40], 0, _Prompt(runner, pool, ids).table, want_logits=True),
        ],
    )
    if not torch.equal(mixed[1], alone):
        failed.append("batched decode")
    return failed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_runner_rows_are_invariant(tiny_runner: ModelRunner, dtype: str) -> None:
    runner = LlamaRunner.from_model_runner(tiny_runner, dtype=dtype)
    for seed, n in enumerate([70, 333, 700]):
        assert _check_invariance(runner, n, seed) == [], (dtype, n)


def test_logits_match_the_hugging_face_forward(tiny_runner: ModelRunner) -> None:
    """Not bitwise (other kernels), but the same model: logits within 1e-4 of the model's forward
    in float64 (torch's float32 forward's distance is in the message, not asserted: its kernels
    are not under test), and the same argmax. The session's tiny model and the reused own runner
    are first checked against fresh ones of the same seed: a test, or a stray write from a kernel,
    that changed a weight would otherwise show here as a numerical difference."""
    fresh = ModelRunner.tiny(seed=0)
    now = tiny_runner.model.state_dict()
    changed = [k for k, t in fresh.model.state_dict().items() if not torch.equal(t, now[k])]
    assert changed == [], f"the session's tiny model is not the one seed 0 makes: {changed}"
    runner = LlamaRunner.from_model_runner(tiny_runner)
    rebuilt = LlamaRunner(fresh, dtype=runner.dtype_name, kernels=runner.kernels.split("-")[0])
    for i, (ours_w, new_w) in enumerate(zip(runner.layers, rebuilt.layers, strict=True)):
        for name, t in ours_w.items():
            same = t is new_w[name] is None or torch.equal(t, new_w[name])
            assert same, f"the reused runner's layer {i} {name} is not the model's"
    for name in ("embed", "norm", "lm_head"):
        assert torch.equal(getattr(runner, name), getattr(rebuilt, name)), f"the reused runner's {name}"
    ids = list(range(5, 205))
    pool = runner.new_pool(64)
    ours = _run(runner, pool, _Prompt(runner, pool, ids), [0, 77])
    with torch.inference_mode():
        theirs = tiny_runner.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        exact = copy.deepcopy(fresh.model).double()(input_ids=torch.tensor([ids])).logits[0, -1]
    err, torch_err = (float((t.double() - exact).abs().max()) for t in (ours, theirs))
    assert err <= 1e-4, (
        f"the own runner ({runner.kernels}, {runner.gemm.tag()}) is {err:.3g} from the float64 "
        f"forward; torch's float32 forward is {torch_err:.3g} from it"
    )
    assert int(ours.argmax()) == int(exact.argmax())


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_rows_are_invariant(real_runner: ModelRunner, dtype: str) -> None:
    runner = LlamaRunner.from_model_runner(real_runner, dtype=dtype)
    assert _check_invariance(runner, 611, 1) == []


@pytest.mark.model
def test_the_checks_catch_a_non_invariant_attention(real_runner: ModelRunner) -> None:
    control = LlamaRunner(real_runner, attention="sdpa")
    failed = _check_invariance(control, 611, 1)
    assert "irregular chunks" in failed and "16-row chunks" in failed


def test_the_checks_catch_a_non_invariant_attention_on_the_tiny_model(tiny_runner: ModelRunner) -> None:
    control = LlamaRunner(tiny_runner, attention="sdpa")
    assert {"irregular chunks", "16-row chunks"} <= set(_check_invariance(control, 700, 0))
