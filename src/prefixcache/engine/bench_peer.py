"""The llama.cpp column of ``prefixcache bench``: llama-cpp-python on the same GGUF, as a peer.

    prefixcache bench --llamacpp-python /work/peers/llama/bin/python

The peer runs in a subprocess of the interpreter given (its own venv: the project does not depend
on it), on the embedded GGUF (Q4_1, the file itself), with the same thread count and the same
token counts as the own runner's figures: single-stream greedy decode after a 32-token prompt
(the median of ``repeats`` generations of ``decode_tokens``), and a cold one-pass prefill of the
long prompt (the best of ``repeats``). A missing interpreter or package is a skip line with
the reason, never an error.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Run by the peer's interpreter: argv[1] is a JSON job; prints one JSON line of figures.
_SCRIPT = r"""
import faulthandler, json, sys, time
faulthandler.enable()  # a crash in the library names the Python frame it happened under
job = json.loads(sys.argv[1])
from llama_cpp import Llama, __version__
llm = Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
            n_ctx=job["n_ctx"], n_batch=512, verbose=False)
out = {"version": __version__}
# decode: greedy tokens after each prompt (first token = the prefill's), timed between tokens;
# the median rate of the prompts
rates = []
for prompt in job["prompts"]:
    times = []
    for i, tok in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        times.append(time.perf_counter())
        if i + 1 >= job["decode_tokens"]:
            break
    rates.append((len(times) - 1) / (times[-1] - times[0]))
out["decode_tps"] = sorted(rates)[len(rates) // 2]
best = None
for _ in range(job["repeats"]):
    llm.reset()
    t = time.perf_counter()
    llm.eval(job["long"])
    dt = time.perf_counter() - t
    best = dt if best is None else min(best, dt)
out["prefill_tokens"] = len(job["long"])
out["prefill_tps"] = len(job["long"]) / best
print(json.dumps(out))
"""


@dataclass(slots=True)
class PeerResult:
    """llama.cpp's figures, or why there are none (``skipped``)."""

    name: str = "llama.cpp"
    version: str = ""
    decode_tps: float = 0.0
    prefill_tokens: int = 0
    prefill_tps: float = 0.0
    skipped: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.version,
            "decode_tps": round(self.decode_tps, 2),
            "prefill_tokens": self.prefill_tokens,
            "prefill_tps": round(self.prefill_tps, 1),
            "skipped": self.skipped,
        }


def run_llamacpp(
    python: str | Path,
    gguf: Path,
    *,
    threads: int,
    vocab: int,
    prefill_tokens: int,
    decode_tokens: int = 129,
    repeats: int = 3,
    seed: int = 0,
    timeout_s: float = 900.0,
) -> PeerResult:
    """llama.cpp's decode and cold prefill rates on ``gguf`` through ``python`` (a skip, with
    the reason, when that interpreter or its llama_cpp package is missing or fails)."""
    exe = Path(python).expanduser()
    if not exe.is_file():
        return PeerResult(
            skipped=f"{exe} does not exist (install: python3 -m venv DIR && "
            "DIR/bin/pip install llama-cpp-python)"
        )
    rng = random.Random(seed)
    job = {
        "gguf": str(gguf),
        "threads": threads,
        "n_ctx": max(prefill_tokens, 32 + decode_tokens) + 64,
        "prompts": [[rng.randrange(0, vocab) for _ in range(32)] for _ in range(repeats)],
        "long": [rng.randrange(0, vocab) for _ in range(prefill_tokens)],
        "decode_tokens": decode_tokens,
        "repeats": repeats,
    }
    try:
        done = subprocess.run(
            [str(exe), "-c", _SCRIPT, json.dumps(job)], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PeerResult(skipped=f"llama.cpp did not run: {exc}")
    if done.returncode < 0:  # killed by a signal: a crash inside llama.cpp, usually
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        where = next((ln.strip() for ln in done.stderr.splitlines() if 'File "' in ln), "")
        at = f" at {where}" if where else ""
        return PeerResult(skipped=f"llama.cpp crashed ({name}) through {exe}{at}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return PeerResult(skipped=f"llama.cpp failed through {exe}: {last}")
    try:
        fig = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return PeerResult(skipped=f"llama.cpp printed no figures through {exe}")
    return PeerResult(
        version=str(fig.get("version", "")),
        decode_tps=float(fig["decode_tps"]),
        prefill_tokens=int(fig["prefill_tokens"]),
        prefill_tps=float(fig["prefill_tps"]),
    )


def peer_lines(peer: PeerResult, own_decode_tps: float, own_prefill_tps: float, q4: bool) -> list[str]:
    """The markdown section of the llama.cpp column."""
    if peer.skipped:
        return ["## llama.cpp", "", f"skipped: {peer.skipped}", ""]
    target = ">= 1x" if q4 else ">= 0.7x"
    return [
        f"## Own runner against llama.cpp (llama-cpp-python {peer.version}, the same GGUF)",
        "",
        "| figure | own | llama.cpp | own / llama.cpp | target |",
        "|---|---:|---:|---:|---:|",
        f"| decode, one stream (tok/s) | {own_decode_tps:.1f} | {peer.decode_tps:.1f} | "
        f"{own_decode_tps / peer.decode_tps:.2f}x | {target} |",
        f"| cold prefill, {peer.prefill_tokens} tokens, one pass (tok/s) | {own_prefill_tps:.0f} | "
        f"{peer.prefill_tps:.0f} | {own_prefill_tps / peer.prefill_tps:.2f}x | |",
        "",
    ]
