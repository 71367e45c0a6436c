"""The native attention kernel alone, at SmolLM2's shapes (9 query heads, 3 KV heads, dim 64).

    PYTHONPATH=src python benchmarks/bench_attention.py [--dtypes bfloat16,float32] [--threads 1]

Figures per dtype, one model layer each: the prompt rows of a cold 2,112-token prefill in
512-token chunks (the prompt path), and one decode step of 8 rows at 1,100 tokens of context
(the decode path): each row on a context of its own, the rows in pairs on 4 shared contexts
(decode rows on one cached prefix read each shared tile once), and the 8 rows on one context,
also as one-row prompt segments. The pool holds random keys and values in a shuffled block table. With one
thread the time is the calling thread's CPU time (what another process on the machine does not
change); with more, wall time. The minimum of ``--rounds``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from prefixcache.engine import kernels
from prefixcache.engine.llama_native import DTYPE_CODES

H, KV, D, B = 9, 3, 64, 16


class Pool:
    def __init__(self, dtype: torch.dtype, blocks: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.blocks = dtype, blocks
        self.keys = torch.randn(KV, blocks, B, D, generator=g).to(dtype)
        self.values = torch.randn(KV, blocks, B, D, generator=g).to(dtype)
        self.table = torch.randperm(blocks, generator=g).to(torch.int32)

    def call(
        self,
        lib: object,
        q: torch.Tensor,
        segs: list[tuple[int, int, int]],
        nt: int,
        tables: list[int] | None = None,
    ) -> None:
        """Segments (start, rows, decode); ``tables``: each segment's offset into the block table."""
        seg: list[int] = []
        row = 0
        for i, (start, n, decode) in enumerate(segs):
            seg.extend((row, n, start, tables[i] if tables else 0, decode))
            row += n
        seg_t = torch.tensor(seg, dtype=torch.long)
        out = torch.empty(row, H, D, dtype=self.dtype)
        lib.pc_attention(  # type: ignore[attr-defined]
            DTYPE_CODES[self.dtype], H, KV, D, q.data_ptr(), self.keys.data_ptr(), self.values.data_ptr(),
            self.blocks * B * D, B, len(segs), seg_t.data_ptr(), self.table.data_ptr(), out.data_ptr(), nt,
        )  # fmt: skip


def timed(fn: object, rounds: int, nt: int) -> float:
    clock = time.thread_time if nt == 1 else time.perf_counter
    best = float("inf")
    for _ in range(rounds):
        t = clock()
        fn()  # type: ignore[operator]
        best = min(best, clock() - t)
    return best


def prompt(lib: object, pool: Pool, chunks: list[tuple[int, int]], qs: list[torch.Tensor], nt: int) -> None:
    for (s, n), qc in zip(chunks, qs, strict=True):
        pool.call(lib, qc, [(s, n, 0)], nt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    k = kernels.load("native")
    if k is None:
        raise SystemExit("the native kernels are not built (python -m prefixcache.engine.kernels)")
    print(f"kernels: {kernels.describe('native')}; threads {args.threads}\n")
    print("| dtype | figure | ms per layer | GMAC/s |")
    print("|---|---|---:|---:|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip())
        length = 2112
        pool = Pool(dtype, length // B + 8)
        q = torch.randn(length, H, D) * D**-0.5 * 3
        chunks = [(s, min(512, length - s)) for s in range(0, length, 512)]
        qs = [q[s : s + n].contiguous() for s, n in chunks]

        t = timed(functools.partial(prompt, k.lib, pool, chunks, qs, args.threads), args.rounds, args.threads)
        macs = sum(n * (s + (n + 1) / 2) for s, n in chunks) * H * D * 2
        what = "prompt rows, cold 2,112 tokens in 512-token chunks"
        print(f"| {name} | {what} | {t * 1e3:.1f} | {macs / t / 1e9:.1f} |")
        ctx = 1100
        pool8 = Pool(dtype, 8 * (ctx // B + 1) + 8, seed=1)
        q8 = torch.randn(8, H, D) * D**-0.5 * 3
        per = ctx // B + 1  # blocks of one context
        cases = (
            (1, list(range(8)), "decode rows, 8 at 1,100 tokens, each its own context"),
            (1, [i // 2 for i in range(8)], "the same, in pairs on 4 shared contexts"),
            (1, [0] * 8, "the same, all 8 on one context"),
            (0, [0] * 8, "the same 8 on one context as prompt rows"),
        )
        for flag, ctx_of, what in cases:
            segs = [(ctx - 1, 1, flag)] * 8
            offsets = [c * per for c in ctx_of]
            t = timed(
                functools.partial(pool8.call, k.lib, q8, segs, args.threads, offsets),
                args.rounds * 4,
                args.threads,
            )
            macs = 8 * ctx * H * D * 2
            print(f"| {name} | {what} | {t * 1e3:.2f} | {macs / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
