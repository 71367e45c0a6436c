"""The llama.cpp column of ``prefixcache bench``: llama-cpp-python on the same GGUF, as a peer.

    prefixcache bench --llamacpp-python /work/peers/llama/bin/python

The peer runs in a subprocess of the interpreter given (its own venv: the project does not depend
on it), on the embedded GGUF (Q4_1, the file itself), with the same thread count and the same
token counts as the own runner's figures: single-stream greedy decode after a 32-token prompt
(the median of ``repeats`` generations of ``decode_tokens``), and a cold one-pass prefill of the
long prompt (the best of ``repeats``). It stays up for the whole run (:class:`LlamaCppPeer`), so
``run_bench`` measures it in turn with the own runner: one own generation, then the peer's on the
same prompt, and so on; one own prefill pass, then the peer's. On a shared machine whose speed
drifts over minutes, both columns then see the same drift (llama.cpp's own decode, run after the
whole own benchmark, gave 148.7 tok/s in one run and 119.6 in the next). A missing interpreter or package,
or a peer that crashes or stalls, is a skip line with the reason, never an error.
"""

from __future__ import annotations

import contextlib
import json
import random
import select
import signal
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

#: Run by the peer's interpreter: argv[1] is a JSON job (model, threads, context). Prints the
#: version as one JSON line, then answers each JSON command read from stdin with one JSON line:
#: {"decode": ids, "tokens": n} -> {"rate": tok/s}; {"prefill": ids} -> {"seconds": s}.
_SCRIPT = r"""
import faulthandler, json, sys, time
faulthandler.enable()  # a crash in the library names the Python frame it happened under
job = json.loads(sys.argv[1])
from llama_cpp import Llama, __version__
llm = Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
            n_ctx=job["n_ctx"], n_batch=512, verbose=False)
print(json.dumps({"version": __version__}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if "decode" in cmd:  # greedy tokens after the prompt (the first: the prefill's), timed between tokens
        times = []
        for i, tok in enumerate(llm.generate(cmd["decode"], top_k=1, temp=0.0, reset=True)):
            times.append(time.perf_counter())
            if i + 1 >= cmd["tokens"]:
                break
        out = {"rate": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0}
    elif "prefill" in cmd:
        llm.reset()
        t = time.perf_counter()
        llm.eval(cmd["prefill"])
        out = {"seconds": time.perf_counter() - t}
    else:
        break
    print(json.dumps(out), flush=True)
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


class LlamaCppPeer:
    """llama-cpp-python kept running in its own interpreter, measured on demand: :meth:`decode`
    and :meth:`prefill` each run one measurement and record it. The first failure (no
    interpreter, no package, a crash, no answer within ``timeout_s``) becomes ``skipped``, with
    the reason, and every later call does nothing. Close it (or use it as a context manager)."""

    def __init__(
        self, python: str | Path, gguf: Path, *, threads: int, n_ctx: int, timeout_s: float = 300.0
    ) -> None:
        self.exe = Path(python).expanduser()
        self.timeout_s = timeout_s
        self.version = ""
        self.skipped = ""
        self.decode_rates: list[float] = []
        self.prefill_s: list[float] = []
        self.prefill_tokens = 0
        self._proc: subprocess.Popen[str] | None = None
        self._err: IO[bytes] | None = None
        if not self.exe.is_file():
            self.skipped = (
                f"{self.exe} does not exist (install: python3 -m venv DIR && "
                "DIR/bin/pip install llama-cpp-python)"
            )
            return
        job = {"gguf": str(gguf), "threads": threads, "n_ctx": n_ctx}
        # stderr to a file, not a pipe: the peer's logs never block it; closed by close()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                [str(self.exe), "-c", _SCRIPT, json.dumps(job)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._err,
                text=True,
            )
        except OSError as exc:
            self._fail(f"llama.cpp did not run: {exc}")
            return
        hello = self._answer()
        if hello is not None:
            self.version = str(hello.get("version", ""))

    def decode(self, prompt: Sequence[int], tokens: int) -> float | None:
        """Greedy ``tokens`` tokens after ``prompt`` (the first is the prefill's); tok/s between
        the first and the last, or None when the peer is skipped."""
        out = self._ask({"decode": list(prompt), "tokens": tokens})
        if out is None:
            return None
        self.decode_rates.append(float(out["rate"]))
        return self.decode_rates[-1]

    def prefill(self, ids: Sequence[int]) -> float | None:
        """One cold pass over ``ids`` (nothing cached); its seconds, or None when skipped."""
        out = self._ask({"prefill": list(ids)})
        if out is None:
            return None
        self.prefill_tokens = len(ids)
        self.prefill_s.append(float(out["seconds"]))
        return self.prefill_s[-1]

    def result(self) -> PeerResult:
        """The medians of the decode rates and the best prefill, or the skip."""
        if not self.skipped and not (self.decode_rates and self.prefill_s):
            self.skipped = f"llama.cpp was not measured through {self.exe}"
        if self.skipped:
            return PeerResult(version=self.version, skipped=self.skipped)
        return PeerResult(
            version=self.version,
            decode_tps=statistics.median(self.decode_rates),
            prefill_tokens=self.prefill_tokens,
            prefill_tps=self.prefill_tokens / min(self.prefill_s),
        )

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()  # the script's loop ends at end of input
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._err is not None:
            self._err.close()
            self._err = None

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        proc = self._proc
        if self.skipped or proc is None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        except OSError:  # it exited: _answer reads why
            pass
        return self._answer()

    def _answer(self) -> dict[str, Any] | None:
        """The peer's next JSON line, or None (and ``skipped``) when it ended, stalled or printed
        something else."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        line = proc.stdout.readline() if ready else None
        if line is None:
            self._fail(f"llama.cpp gave no answer within {self.timeout_s:.0f} s through {self.exe}")
            return None
        if not line:  # end of output: it exited
            self._ended(proc)
            return None
        try:
            out = json.loads(line)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            self._fail(f"llama.cpp printed no figures through {self.exe}")
            return None
        return out

    def _ended(self, proc: subprocess.Popen[str]) -> None:
        code = proc.wait()
        err = ""
        if self._err is not None:
            self._err.seek(0)
            err = self._err.read().decode(errors="replace")
        if code < 0:  # killed by a signal: a crash inside llama.cpp, usually
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            where = next((ln.strip() for ln in err.splitlines() if 'File "' in ln), "")
            at = f" at {where}" if where else ""
            self._fail(f"llama.cpp crashed ({name}) through {self.exe}{at}")
        else:
            last = (err.strip().splitlines() or ["no output"])[-1]
            self._fail(f"llama.cpp failed through {self.exe}: {last}")

    def _fail(self, reason: str) -> None:
        if not self.skipped:
            self.skipped = reason
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):  # a broken pipe to a dead peer
                        f.close()


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
    """llama.cpp's decode and cold prefill rates on ``gguf`` through ``python``, on their own (a
    skip, with the reason, when that interpreter or its llama_cpp package is missing or fails).
    ``prefixcache bench`` measures them in turn with its own instead (``run_bench(peer=...)``)."""
    rng = random.Random(seed)
    n_ctx = max(prefill_tokens, 32 + decode_tokens) + 64
    with LlamaCppPeer(python, gguf, threads=threads, n_ctx=n_ctx, timeout_s=timeout_s) as peer:
        for _ in range(repeats):
            peer.decode([rng.randrange(0, vocab) for _ in range(32)], decode_tokens)
        long = [rng.randrange(0, vocab) for _ in range(prefill_tokens)]
        for _ in range(repeats):
            peer.prefill(long)
        return peer.result()


def peer_lines(peer: PeerResult, own_decode_tps: float, own_prefill_tps: float, q4: bool) -> list[str]:
    """The markdown section of the llama.cpp column."""
    if peer.skipped:
        return ["## llama.cpp", "", f"skipped: {peer.skipped}", ""]
    target = ">= 1x" if q4 else ">= 0.7x"
    return [
        f"## Own runner against llama.cpp (llama-cpp-python {peer.version}, the same GGUF)",
        "",
        "Measured in turn: each own decode and one-pass prefill, then llama.cpp's on the same tokens.",
        "",
        "| figure | own | llama.cpp | own / llama.cpp | target |",
        "|---|---:|---:|---:|---:|",
        f"| decode, one stream (tok/s) | {own_decode_tps:.1f} | {peer.decode_tps:.1f} | "
        f"{own_decode_tps / peer.decode_tps:.2f}x | {target} |",
        f"| cold prefill, {peer.prefill_tokens} tokens, one pass (tok/s) | {own_prefill_tps:.0f} | "
        f"{peer.prefill_tps:.0f} | {own_prefill_tps / peer.prefill_tps:.2f}x | |",
        "",
    ]
