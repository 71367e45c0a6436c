"""Quality of the 4-bit weights (``--weights q4`` and ``q4a8``) against the float weights, on the own runner.

    .venv/bin/python benchmarks/bench_quality.py            # writes benchmarks/results/quality.{md,json}
    .venv/bin/python benchmarks/bench_quality.py --tokens 256 --windows 2   # shorter

Two figures, both on fixed inputs shipped in the repository:

- **Perplexity** of ``benchmarks/data/quality.txt`` (project-written English, about 3 KB),
  teacher-forced through *decode* steps (the rows where the 4-bit weights are read in place:
  prefill rows of the 4-bit model use the same 4-bit values dequantized, which equal the float
  weights of the embedded GGUF). On the own quantized kernels both columns are equal by
  construction (their decode rows compute the float weights' bits); ``PREFIXCACHE_Q4=torch``
  measures torch's int4 kernel instead. ``q4a8`` (decode and logits rows quantized to 8 bits a
  group of 32, integer group dot products, as llama.cpp computes Q4_1) is another model
  numerically: this is the figure that says how far. The text is cut into ``--windows`` windows decoded
  together in one batch (rows are invariant, so batching does not change a figure).
- **Greedy agreement**: for each of the prompts below, the share of the first ``--new`` greedy
  tokens equal to the float weights' token at the same position (up to the shorter answer when
  one stops early), and the length of the common prefix.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from prefixcache.engine.engine import Engine
from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.model import ModelRunner

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "Write a short paragraph about the history of bicycles.",
    "Explain what a prefix cache in an inference server does.",
    "Give three tips for keeping a vegetable garden healthy.",
    "What is the difference between a lake and a sea?",
    "Describe a quiet morning in a small harbour town.",
    "List the steps to make a cup of tea.",
    "Why do leaves change colour in autumn?",
    "Summarise the rules of chess in a few sentences.",
]


def perplexity(runner: LlamaRunner, ids: list[int], windows: int, start: int = 16) -> tuple[float, int]:
    """exp(mean NLL) of ``ids`` split into ``windows`` windows: each prefilled for ``start``
    tokens, then teacher-forced one decode row per token (all windows in one step)."""
    per = len(ids) // windows
    seqs = [ids[w * per : (w + 1) * per] for w in range(windows)]
    pool = runner.new_pool(windows * (per // 16 + 2) + 1)
    tables = [[pool.alloc().index for _ in range(per // 16 + 2)] for _ in seqs]
    pairs = list(zip(seqs, tables, strict=True))
    logits = runner.step(pool, [Segment(s[:start], 0, t, want_logits=True) for s, t in pairs])
    nll, count = 0.0, 0
    for pos in range(start, per):
        lp = torch.log_softmax(logits.float(), -1)
        for w, s in enumerate(seqs):
            nll -= float(lp[w, s[pos]])
            count += 1
        if pos + 1 < per:
            segs = [Segment([s[pos]], pos, t, decode=True, want_logits=True) for s, t in pairs]
            logits = runner.step(pool, segs)
    return math.exp(nll / count), count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, default=HERE / "data" / "quality.txt")
    ap.add_argument("--tokens", type=int, default=512, help="Tokens of the text scored (default 512).")
    ap.add_argument("--windows", type=int, default=4, help="Windows decoded together (default 4).")
    ap.add_argument("--new", type=int, default=48, help="Greedy tokens per prompt (default 48).")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the engine's).")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()

    base = ModelRunner.load(threads=args.threads)
    formats = ("float", "q4", "q4a8")
    engines = {w: Engine(base, dtype=args.dtype, weights=w, enable_cache=False) for w in formats}
    ids = base.tokenizer(args.text.read_text())["input_ids"][: args.tokens]
    res: dict[str, object] = {"dtype": engines["float"].runner.dtype_name, "text_tokens": len(ids)}
    for w, e in engines.items():
        t = time.perf_counter()
        ppl, n = perplexity(e.runner, ids, args.windows)  # type: ignore[arg-type]
        res[f"ppl_{w}"] = round(ppl, 3)
        res["scored_tokens"] = n
        print(
            f"perplexity, {w} weights: {ppl:.3f} over {n} tokens ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    answers = {
        w: [
            e.generate(messages=[{"role": "user", "content": p}], max_tokens=args.new).tokens for p in PROMPTS
        ]
        for w, e in engines.items()
    }
    for w in formats[1:]:
        same, total, prefixes = 0, 0, []
        for a, b in zip(answers["float"], answers[w], strict=True):
            k = min(len(a), len(b))
            same += sum(x == y for x, y in zip(a[:k], b[:k], strict=True))
            total += k
            prefixes.append(next((i for i in range(k) if a[i] != b[i]), k))
        res[f"greedy_agreement_{w}"] = round(same / total, 4)
        res[f"common_prefix_mean_{w}"] = round(sum(prefixes) / len(prefixes), 1)
        res[f"common_prefixes_{w}"] = prefixes
    res["new_tokens"] = args.new
    for e in engines.values():
        e.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(res, indent=2) + "\n")
    md = [
        "# 4-bit weights against the float weights",
        "",
        f"`python {' '.join(shlex.quote(a) for a in sys.argv)}` (dtype {res['dtype']}, "
        f"{base.threads} threads), text `benchmarks/data/quality.txt`. The perplexity is of this "
        "small, already 4-bit-derived model on short windows: compare the columns, not the value. "
        "q4 reads the GGUF's Q4_1 groups and computes the float weights' bits; q4a8 also quantizes "
        "decode and logits rows to 8 bits a group of 32 (integer group dot products).",
        "",
        "| figure | " + " | ".join(formats) + " |",
        "|---|" + "---:|" * len(formats),
        f"| perplexity, {res['scored_tokens']} tokens teacher-forced by decode steps | "
        + " | ".join(str(res[f"ppl_{w}"]) for w in formats)
        + " |",
        f"| greedy tokens equal to float's, {len(PROMPTS)} prompts x {args.new} | 100% | "
        + " | ".join(f"{res[f'greedy_agreement_{w}']:.1%}" for w in formats[1:])
        + " |",
        f"| mean common prefix (tokens) | {args.new} | "
        + " | ".join(str(res[f"common_prefix_mean_{w}"]) for w in formats[1:])
        + " |",
        "",
    ]
    (args.out / "quality.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
