"""Write the embedded SmolLM2-135M-Instruct as a Hugging Face model folder (for peers such as vLLM).

    .venv/bin/python benchmarks/export_hf.py /work/peers/smollm2-hf

The folder holds the weights the engine loads (the GGUF dequantized to float32, safetensors) and
the tokenizer with its chat template, so a peer serves the same model from the same numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefixcache.engine.model import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="Where the model folder goes (created).")
    ap.add_argument("--model", default=None, help="A .gguf file or model folder (default: the embedded one).")
    args = ap.parse_args()
    runner = ModelRunner.load(args.model, device="cpu")
    args.folder.mkdir(parents=True, exist_ok=True)
    runner.model.save_pretrained(args.folder)
    runner.tokenizer.save_pretrained(args.folder)
    params = sum(p.numel() for p in runner.model.parameters())
    print(f"wrote {args.folder} ({runner.name}, {params:,} parameters)")


if __name__ == "__main__":
    main()
