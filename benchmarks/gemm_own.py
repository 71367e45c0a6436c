"""The own GEMM (``kernels/pc_gemm.c``) against the torch rule's pieces, at SmolLM2's shapes.

    PYTHONPATH=src python benchmarks/gemm_own.py [--rows 1 8 128 512] [--rounds 7]
    PYTHONPATH=src python benchmarks/gemm_own.py --kind prefill --rows 16 32 64 128 512 2112

For each dtype and row count: one layer's four weight products (q/k/v, o, gate/up, down) by the
own GEMM (every row count in one call) and by the torch rule (float32 decode rows padded to 16,
bf16 decode rows unpadded up to 32, prefill rows in zero-padded 128-row pieces). Interleaved A/B
in one process, the minimum of ``--rounds`` rounds each (a loaded machine's noise only adds). Rows
are decode rows below 128 and prefill rows from 128 on (``--kind`` sets one kind for all); prefill
rows go where the rule sends them (the own GEMM's lanes order, its prompt-rows arithmetic where
``PROMPT_ROWS_ISAS`` says, or torch's pieces). The prefill figures decide ``engine/gemm.py``'s
``OWN_PREFILL_ISAS`` and ``PROMPT_ROWS_ISAS``.
"""

from __future__ import annotations

import argparse
import time

import torch

from prefixcache.engine.gemm import Rows, gemm_rule

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128, 256, 512])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kind", choices=("auto", "decode", "prefill"), default="auto", help="the rows' class")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; ms per layer (4 GEMMs), min of {args.rounds} interleaved rounds")
    for dt in (torch.bfloat16, torch.float32):
        own = gemm_rule(dt, torch.device("cpu"), kernels="native")
        ref = gemm_rule(dt, torch.device("cpu"), kernels="torch")
        if not own.own:
            print(f"{dt}: no own GEMM path here")
            continue
        print(f"{str(dt)[6:]}: {own.tag()} against {ref.tag()}")
        gen = torch.Generator().manual_seed(0)
        ws = [(torch.randn(n, k, generator=gen) * 0.05).to(dt) for n, k in SHAPES]
        for m in args.rows:
            xs = [torch.randn(m, k, generator=gen).to(dt) for _, k in SHAPES]
            best = {"own": 1e9, "torch": 1e9}
            for _ in range(args.rounds):
                for name, rule in (("own", own), ("torch", ref)):
                    decode = m < 128 if args.kind == "auto" else args.kind == "decode"
                    rows = Rows(m, ((0, m, decode),))
                    t0 = time.perf_counter()
                    for x, w in zip(xs, ws, strict=True):
                        rule.linear(x, w, None, rows)
                    best[name] = min(best[name], time.perf_counter() - t0)
            kind = ("decode" if m < 128 else "prefill") if args.kind == "auto" else args.kind
            print(
                f"{str(dt)[6:]:9s} {kind:7s} M={m:4d}  own {best['own'] * 1e3:8.3f}  "
                f"torch {best['torch'] * 1e3:8.3f}  own/torch {best['own'] / best['torch']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
