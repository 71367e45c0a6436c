"""Tenant isolation: tenant B's time to first token while tenant A floods the cache with new
prompts and flushes, and every tier read or tier flush takes 200 ms (a slow but answering Redis).

    python benchmarks/bench_tenants.py [--requests 20] [--out benchmarks/results/tenants.md]

One engine over the embedded SmolLM2 (the cache on, a tier below memory that sleeps 200 ms in
every read and every namespace removal before answering "nothing held": a stand-in for a slow
Redis, so the figures measure waiting, not Redis). Tenant B sends greedy requests whose prompts
are warm in memory (full hits: B itself never reads the tier); its TTFT is the time from the
call to the first decoded token. Three scenarios, interleaved request by request over rounds:

* ``idle``: B alone;
* ``flood``: A meanwhile sends new prompts (each a miss that reads the slow tier) and flushes its
  namespace (memory in slices, then the tier) in a loop, as the engine runs now (tier reads in
  the request's own prefetch, outside the cache's lock);
* ``flood, reads under the lock``: the same with ``promote_in_match`` on (no prefetch; tier
  reads inside ``match``, under the lock, on the step thread: the behaviour before).

Writes a Markdown table and a PNG next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DELAY_S = 0.2
SYSTEM = "You are the assistant of a ferry line. Answer in one short sentence. " * 6


class SlowTier:
    """A tier that answers every read and every namespace removal after ``DELAY_S``, holding
    nothing (a slow Redis whose entries were all evicted)."""

    name = "slow"
    write_through = True

    def __init__(self) -> None:
        from prefixcache.cache.tiers.base import TierStats

        self._stats = TierStats(self.name)
        self.reads = 0

    def get_many(
        self, keys: Sequence[bytes], tokens: Sequence[bytes], namespace: bytes, layout: Any = None
    ) -> list[tuple[Any, int]]:
        self.reads += 1
        time.sleep(DELAY_S)
        return []

    def put(self, block: Any) -> None:
        pass

    def remove_namespace(self, namespace: bytes) -> int:
        time.sleep(DELAY_S)
        return 0

    def stats(self) -> Any:
        return self._stats


def ttft(engine: Any, question: str, tenant: str) -> float:
    """Seconds from the call to the first decoded token of one greedy request."""
    from prefixcache.engine.types import ChoiceDelta

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    t0 = time.perf_counter()
    first = None
    for item in engine.stream_choices(messages, max_tokens=2, tenant=tenant, salt=tenant):
        if first is None and isinstance(item, ChoiceDelta):
            first = time.perf_counter() - t0
    assert first is not None
    return first


def flood(engine: Any, stop: threading.Event, counts: dict[str, int]) -> None:
    """Tenant A: new prompts (misses that read the slow tier) and flushes, until ``stop``."""
    ns = engine.namespace("tenant-a", "tenant-a")
    i = 0
    while not stop.is_set():
        i += 1
        messages = [{"role": "user", "content": f"Flood {i}: tides?"}]  # little compute, one tier read
        engine.generate(messages=messages, max_tokens=1, tenant="tenant-a", salt="tenant-a")
        counts["requests"] += 1
        if i % 2 == 0:
            engine.cache.flush(ns)
            engine.cache.remove_tier_entries(ns)
            counts["flushes"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20, help="B requests per scenario")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tenants.md")
    args = ap.parse_args()

    from prefixcache.engine import Engine

    with Engine(None, threads=1) as engine:  # closed (its worker thread ended) on every path
        run(engine, args)


def run(engine: Any, args: argparse.Namespace) -> None:
    """The three scenarios on ``engine``; the table to ``args.out``, the plot beside it."""
    from prefixcache.engine.runtime import describe_runtime

    tier = SlowTier()
    engine.cache.add_tier(tier)
    questions = ["When do you sail?", "Where do you dock?", "Can I bring a bike?", "Is there a cafe?"]
    for q in questions:  # B's prompts: warm in memory from here on (full hits, no tier read)
        ttft(engine, q, "tenant-b")
    scenarios = ["idle", "flood", "flood, reads under the lock"]
    samples: dict[str, list[float]] = {s: [] for s in scenarios}
    counts = {s: {"requests": 0, "flushes": 0, "tier reads": 0} for s in scenarios}
    for r in range(args.requests):
        for s in scenarios:
            engine.cache.promote_in_match = s == "flood, reads under the lock"
            stop = threading.Event()
            a = None
            reads = tier.reads  # A's tier reads over its whole flood, not only during B's request
            if s != "idle":
                a = threading.Thread(target=flood, args=(engine, stop, counts[s]))
                a.start()
                time.sleep(0.3)  # A is flooding before B asks
            samples[s].append(ttft(engine, questions[r % len(questions)], "tenant-b"))
            stop.set()
            if a is not None:
                a.join()
            counts[s]["tier reads"] += tier.reads - reads
    engine.cache.promote_in_match = False
    rows = []
    for s in scenarios:
        xs = sorted(samples[s])
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        rows.append((s, statistics.median(xs), p90, counts[s]))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# Tenant isolation: B's TTFT while A floods",
        "",
        f"`python benchmarks/bench_tenants.py {' '.join(sys.argv[1:])}` ({when}; {os.cpu_count()} CPUs "
        f"shared with other work, load average {os.getloadavg()[0]:.1f} at the end: a short run, "
        "wall-clock figures are noisy here).",
        "",
        f"Engine: embedded SmolLM2, `{describe_runtime(engine)}`; a tier that answers every read and "
        f"flush in {DELAY_S * 1000:.0f} ms (a slow Redis). B's prompts are full hits in memory; A sends "
        "new prompts (each reads the tier) and flushes its namespace every second request. "
        f"{args.requests} B requests per scenario, the scenarios interleaved request by request.",
        "",
        "| scenario | B's TTFT p50 | B's TTFT p90 | A's requests / flushes / tier reads meanwhile |",
        "|---|---|---|---|",
        *[
            f"| {s} | {p50 * 1000:.0f} ms | {p90 * 1000:.0f} ms "
            f"| {c['requests']} / {c['flushes']} / {c['tier reads']} |"
            for s, p50, p90, c in rows
        ],
        "",
        "`flood` is the engine as it runs now: A's tier reads happen in its own prefetch, outside the "
        "cache's lock, and its flushes take the lock a slice of runs at a time. `flood, reads under "
        "the lock` turns `promote_in_match` back on: A's tier reads then run inside `match`, under "
        "the lock, on the step thread that also serves B. What is left between `idle` and `flood` is "
        "A's own compute: its prefills share the engine's steps (and here two CPUs with other work), "
        "which no lock removes.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([[v * 1000 for v in samples[s]] for s in scenarios], tick_labels=scenarios)
    ax.set_ylabel("tenant B TTFT (ms)")
    ax.set_title(f"B's TTFT while A floods (tier answers in {DELAY_S * 1000:.0f} ms)")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
