"""The own runner on the native kernels against the torch path, side by side in one process.

python benchmarks/bench_kernels.py --dtypes bfloat16,float32 --threads 2

For each dtype and kernel set, on SmolLM2 (runner.step directly, no server): single-stream decode
(tok/s at 100 and at 1,100 tokens of context), one decode step of 8 rows at 1,100 tokens each, and
a cold prefill of 2,112 tokens in one pass and in 512-token steps. The two kernel sets alternate
figure by figure, so a machine whose load changes affects both alike; the ratio column is what
to read on a shared machine. Prints a markdown table.

``--compare gemm``: both columns on the native kernels, the own GEMM rule (``engine/gemm.py``)
against the torch GEMM rule (F.linear in fixed-shape pieces).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections.abc import Callable

import torch

from prefixcache.engine.gemm import gemm_rule
from prefixcache.engine.kernels import describe
from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.model import ModelRunner


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Setup:
    """A pool with 8 sequences sharing a 2,112-token random prompt's blocks."""

    def __init__(self, runner: LlamaRunner, seed: int = 0) -> None:
        self.runner = runner
        self.pool = runner.new_pool(8 * 140 + 300)
        rng = random.Random(seed)
        self.ids = [rng.randrange(0, runner.vocab_size) for _ in range(2112)]
        self.blocks = [[self.pool.alloc() for _ in range(140)] for _ in range(3)]
        self.tables = [[b.index for b in bl] for bl in self.blocks]
        runner.step(self.pool, [Segment(self.ids, 0, self.tables[0])])
        # 8 decode rows over the same 1,100-token context (each writes its own slot 1,100)
        self.rows = [[*self.tables[0][:68], *[b.index for b in self._own(72)]] for _ in range(8)]

    def _own(self, n: int) -> list:  # blocks kept alive by the setup
        got = [self.pool.alloc() for _ in range(n)]
        self.blocks.append(got)
        return got

    def prefill_one_pass(self) -> None:
        self.runner.step(self.pool, [Segment(self.ids, 0, self.tables[1], want_logits=True)])

    def prefill_steps(self) -> None:
        for a in range(0, 2112, 512):
            self.runner.step(self.pool, [Segment(self.ids[a : a + 512], a, self.tables[2], want_logits=True)])

    def decode(self, context: int, rows: int) -> None:
        segs = [Segment([5], context, self.rows[i], decode=True, want_logits=True) for i in range(rows)]
        self.runner.step(self.pool, segs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per figure (medians)")
    ap.add_argument("--compare", choices=("kernels", "gemm"), default="kernels")
    args = ap.parse_args()
    base = ModelRunner.load(threads=args.threads)
    print(f"kernels: {describe('native')}; torch threads: {torch.get_num_threads()}\n")
    cols = ("own GEMM", "torch GEMM") if args.compare == "gemm" else ("native", "torch")
    print(f"| dtype | figure | {cols[0]} | {cols[1]} | speed-up |")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        if args.compare == "gemm":
            own = LlamaRunner.from_model_runner(base, dtype=dtype, kernels="native")
            ref = copy.copy(own)
            shapes = {
                tuple(t.shape) for lw in own.layers for t in lw.values() if t is not None and t.dim() == 2
            }
            shapes.add(tuple(own.lm_head.shape))
            ref.gemm = gemm_rule(own.dtype, own.device, sorted(shapes), "torch")
            print(f"{dtype}: {own.gemm.tag()} against {ref.gemm.tag()}")
            setups = {"native": _Setup(own), "torch": _Setup(ref)}
        else:
            setups = {
                k: _Setup(LlamaRunner.from_model_runner(base, dtype=dtype, kernels=k))
                for k in ("native", "torch")
            }
        figures: list[tuple[str, Callable[[_Setup], Callable[[], object]], int, bool]] = [
            ("decode, 1 row at 100 tokens (tok/s)", lambda s: lambda: s.decode(100, 1), 1, True),
            ("decode, 1 row at 1,100 tokens (tok/s)", lambda s: lambda: s.decode(1100, 1), 1, True),
            ("decode step, 8 rows at 1,100 tokens (ms)", lambda s: lambda: s.decode(1100, 8), 0, False),
            ("cold prefill, 2,112 tokens, one pass (tok/s)", lambda s: s.prefill_one_pass, 2112, True),
            ("cold prefill, 2,112 tokens, 512-token steps (tok/s)", lambda s: s.prefill_steps, 2112, True),
        ]
        for name, make, tokens, rate in figures:
            reps = max(1, args.repeats if tokens <= 8 else args.repeats // 2)
            got = {k: _median_s(make(s), reps) for k, s in setups.items()}
            if rate:
                n, t = tokens / got["native"], tokens / got["torch"]
                print(f"| {dtype} | {name} | {n:.1f} | {t:.1f} | {n / t:.2f}x |", flush=True)
            else:
                n, t = got["native"] * 1e3, got["torch"] * 1e3
                print(f"| {dtype} | {name} | {n:.1f} | {t:.1f} | {t / n:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
