"""Single-stream decode with 4-bit weights: tokens/s per kernel, measured interleaved in one process.

    PYTHONPATH=src python benchmarks/profile_decode.py [--tokens 32] [--rounds 3] [--threads 2]

Runs ``--rounds`` rounds; each round generates ``--tokens`` greedy tokens (cache off) with the
bf16 weights, q4 through torch's int4 kernel and q4 through the own ``pc_q4.c`` kernel, one after
the other, and keeps each one's best round (the machine may be shared: best-of is the least noisy).
Also times the 4-bit projections alone for one decode row (per token: all layers' GEMMs).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from prefixcache.engine.engine import Engine
from prefixcache.engine.model import ModelRunner


def _gemm_ms(runner: object, reps: int = 5) -> float:
    layers = runner.layers  # type: ignore[attr-defined]
    x = {k: torch.randn(1, w.shape[1]).to(runner.dtype) for k, w in layers[0].items() if hasattr(w, "linear")}  # type: ignore[attr-defined]
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        for lw in layers:
            for k, xi in x.items():
                lw[k].linear(xi, True)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base = ModelRunner.load()
    engines = {}
    for name, weights, kernel in (("bf16", "float", "torch"), ("q4-int4", "q4", "torch"), ("q4-own", "q4", "own")):
        os.environ["PREFIXCACHE_Q4"] = kernel
        engines[name] = Engine(base, weights=weights, enable_cache=False)
    best = dict.fromkeys(engines, 0.0)
    prompt = "Write a long story about a lighthouse keeper and the sea, with many details."
    for _ in range(a.rounds):
        for name, e in engines.items():
            r = e.generate(prompt=prompt, max_tokens=a.tokens + 1)
            n = len(r.tokens) - 1  # the first token is the prefill's
            best[name] = max(best[name], n / max(r.decode_s, 1e-9))
    for name, e in engines.items():
        gm = _gemm_ms(e.runner) if name != "bf16" else float("nan")
        print(f"{name:8s} decode {best[name]:6.1f} tok/s   4-bit projections, one row: {gm:.2f} ms/token")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
