"""Where the compute thread's time goes under N concurrent requests (in process, no HTTP).

    .venv/bin/python benchmarks/profile_steps.py --clients 1,8 --max-tokens 32
    .venv/bin/python benchmarks/profile_steps.py --clients 8 --weights float

N threads each run chats (a shared ~600-token system prompt, its own question) one after another
through ``Engine.generate_stream``; timers wrap the worker thread's phases: the model step
(``runner.step``), the rest of each step (sampling, logprobs, detokenization, stop strings,
committing blocks), admission and intake (hashing, cache lookup, reservations). The callers'
tokenization and text handling run on their own threads and show only as wall time. Prints one
table: output tok/s, steps, rows per step and milliseconds per step in each phase.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from typing import Any

from prefixcache.engine.engine import Engine
from prefixcache.engine.model import ModelRunner

SYSTEM = (
    "You are the help desk of a regional railway. Answer in one or two short sentences, politely, "
    "and never invent timetables: when you do not know, say so and point to the ticket office. "
) * 12
QUESTIONS = [
    "When does the first train leave?",
    "Can I take my bicycle on board?",
    "Is there a discount for students?",
    "Where can I buy a ticket?",
    "Do trains run on public holidays?",
    "Is the station accessible by wheelchair?",
    "How early should I arrive?",
    "Can I change my reservation?",
]


def _timed(obj: Any, name: str, acc: dict[str, float]) -> None:
    inner = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def run(base: ModelRunner, clients: int, max_tokens: int, per_client: int, weights: str) -> dict[str, float]:
    engine = Engine(base, weights=weights, max_batch=max(16, clients))
    worker: Any = engine._worker
    acc: dict[str, float] = defaultdict(float)
    for name in ("_step", "_admit", "_intake"):
        _timed(worker, name, acc)
    engine.generate(messages=[{"role": "user", "content": "warm up"}], max_tokens=2)
    engine.generate(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}], max_tokens=1
    )
    time.sleep(0.5)  # the warm-up's last step (its commit) ends after its answer: keep it out
    s0, st0, rows0 = worker.steps, worker.step_s, worker.decoded_rows
    acc.clear()
    out_tokens = [0] * clients

    def client(i: int) -> None:
        for j in range(per_client):
            q = QUESTIONS[(i + j * clients) % len(QUESTIONS)] + f" (ticket {i}-{j})"
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            r = engine.generate(messages=msgs, max_tokens=max_tokens)
            out_tokens[i] += r.usage.completion_tokens

    t = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    steps = worker.steps - s0
    model_s = worker.step_s - st0
    engine.close()
    return {
        "clients": clients,
        "wall_s": wall,
        "out_tps": sum(out_tokens) / wall,
        "steps": steps,
        "rows_per_step": (worker.decoded_rows - rows0) / max(steps, 1),
        "model_ms": 1e3 * model_s / max(steps, 1),
        "rest_of_step_ms": 1e3 * (acc["_step"] - model_s) / max(steps, 1),
        "admit_intake_ms": 1e3 * (acc["_admit"] + acc["_intake"]) / max(steps, 1),
        "idle_ms": 1e3 * (wall - acc["_step"] - acc["_admit"] - acc["_intake"]) / max(steps, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8", help="Comma-separated concurrency levels (default 1,8).")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chats", type=int, default=2, help="Chats per client (default 2).")
    ap.add_argument("--weights", default="auto", help="auto (the default), float or q4.")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    base = ModelRunner.load(threads=args.threads)
    rows = [run(base, int(c), args.max_tokens, args.chats, args.weights) for c in args.clients.split(",")]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if len(rows) > 1:
        print(
            f"output tok/s, {rows[-1]['clients']} clients / {rows[0]['clients']}: "
            f"{rows[-1]['out_tps'] / rows[0]['out_tps']:.2f}x"
        )


if __name__ == "__main__":
    main()
