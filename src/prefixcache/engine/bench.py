"""``prefixcache bench``: cold, warm and floor TTFT, 0%-hit overhead, exact vs single-pass
prefill, hashing + lookup of a long prompt. Ratios are measured within one run; medians of repeats.

- cold: prefix + tail, nothing cached (a fresh random prefix per repeat).
- warm: the same prefix with another tail, after the cold request stored it.
- floor: the tail alone forwarded over a prebuilt DynamicCache of the prefix (no cache layer,
  no KV assembly): the least a hit can cost.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.cache import PrefixCache
from prefixcache.engine import kv
from prefixcache.engine.engine import Engine, chunk_schedule
from prefixcache.engine.model import ModelRunner

Progress = Callable[[str], None]


@dataclass(slots=True)
class TtftRow:
    prefix: int
    cached: int
    cold_s: float
    warm_s: float
    floor_s: float
    warm_over_floor: float  # median of per-repeat warm/floor (each pair ran back to back)

    @property
    def speedup(self) -> float:
        return self.cold_s / self.warm_s


@dataclass(slots=True)
class BenchResult:
    model: str
    dtype: str
    threads: int
    prefill_chunk: int
    tail: int
    repeats: int
    rows: list[TtftRow] = field(default_factory=list)
    overhead_tokens: int = 0
    miss_on_s: float = 0.0  # cache on, 0% hit: TTFT + commit
    miss_off_s: float = 0.0  # cache off, same prompt
    overhead_paired: float = 0.0  # median over repeats of on/off - 1
    prefill_tokens: int = 0
    single_pass_tps: float = 0.0
    chunked_tps: float = 0.0
    decode_tps: float = 0.0
    hash_tokens: int = 50_000
    hash_lookup_ms: float = 0.0
    kv_bytes_per_token: int = 0

    @property
    def exact_ratio(self) -> float:
        return self.chunked_tps / self.single_pass_tps


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ordinary vocabulary range (skips the low ids where special tokens live).
    return [rng.randrange(100, vocab) for _ in range(n)]


def prefill_rates(runner: ModelRunner, ids: Sequence[int], chunk: int, repeats: int) -> tuple[float, float]:
    """Tokens/s of a cold prefill of ``ids``: (one forward pass, absolute ``chunk``-token chunks).

    The two are interleaved repeat by repeat, so a change in machine load hits both alike.
    """
    schedules = ([(0, len(ids))], chunk_schedule(0, len(ids), chunk))

    def once(spans: list[tuple[int, int]]) -> float:
        past = runner.new_cache()
        t = time.perf_counter()
        for a, b in spans:
            runner.forward(ids[a:b], past)
        return time.perf_counter() - t

    once(schedules[0])  # warm-up: allocator and kernels
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for spans, acc in zip(schedules, times, strict=True):
            acc.append(once(spans))
    return len(ids) / statistics.median(times[0]), len(ids) / statistics.median(times[1])


def hash_lookup_ms(tokens: int = 50_000, repeats: int = 5, block_size: int = 16) -> float:
    """Median ms of ``cache.match`` (keys + lookup + release) on a fully cached prompt."""
    cache = PrefixCache(block_size=block_size, capacity_bytes=1 << 40)
    ns = cache.namespace("bench", tenant="bench")
    ids = list(range(tokens))
    m = cache.match(ids, ns)
    cache.commit(m, lambda i: (None, 1))
    cache.release(m)

    def once() -> float:
        t = time.perf_counter()
        hit = cache.match(ids, ns)
        cache.release(hit)
        return (time.perf_counter() - t) * 1e3

    return _median(once, repeats)


def _prefix_kv(engine: Engine, prefix: list[int], tail: list[int]) -> Any:
    """A DynamicCache of ``prefix``: from the engine's cache when it holds all of it (the cold
    request stored it), else by prefilling it on the same chunk schedule."""
    runner, n = engine.runner, len(prefix)
    if engine.cache is not None:
        m = engine.cache.match(prefix + tail, engine.namespace(), align_tokens=engine.prefill_chunk)
        try:
            if m.cached_tokens == n:
                return kv.build_cache(runner, [b.payload for b in m.blocks])
        finally:
            engine.cache.release(m)
    past = runner.new_cache()
    for a, b in chunk_schedule(0, n, engine.prefill_chunk):
        runner.forward(prefix[a:b], past)
    return past


def run_bench(
    runner: ModelRunner,
    *,
    lengths: Sequence[int] = (256, 512, 1024, 1536, 2048),
    tail: int = 64,
    repeats: int = 3,
    prefill_chunk: int | None = None,
    progress: Progress | None = None,
    seed: int = 0,
) -> BenchResult:
    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    vocab = min(runner.vocab_size, 40_000)
    on = Engine(runner, prefill_chunk=prefill_chunk)
    off = Engine(runner, prefill_chunk=on.prefill_chunk, enable_cache=False)
    chunk = on.prefill_chunk
    res = BenchResult(runner.name, runner.dtype_name, runner.threads, chunk, tail, repeats)
    res.kv_bytes_per_token = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * runner.dtype.itemsize
    on.generate(prompt_token_ids=_ids(rng, 64, vocab), max_tokens=1)  # warm-up
    for n in lengths:
        say(f"TTFT, prefix {n} + tail {tail}")
        cold, warm, floor = [], [], []
        cached = 0
        for _ in range(repeats):
            prefix = _ids(rng, n, vocab)
            r = on.generate(prompt_token_ids=prefix + _ids(rng, tail, vocab), max_tokens=1)
            cold.append(r.ttft_s)
            r = on.generate(prompt_token_ids=prefix + _ids(rng, tail, vocab), max_tokens=1)
            warm.append(r.ttft_s)
            cached = r.usage.cached_tokens
            # floor: the prefix's KV prebuilt (outside the timer), then the tail alone
            tail_ids = _ids(rng, tail, vocab)
            fresh = _prefix_kv(on, prefix, tail_ids)
            t = time.perf_counter()
            runner.forward(tail_ids, fresh)
            floor.append(time.perf_counter() - t)
        paired = statistics.median(w / f for w, f in zip(warm, floor, strict=True))
        res.rows.append(TtftRow(n, cached, statistics.median(cold), statistics.median(warm), statistics.median(floor), paired))
    n = max(lengths) + tail
    res.overhead_tokens = n
    say(f"0%-hit overhead, {n} tokens, cache on vs off")
    on_t, off_t = [], []
    for _ in range(repeats):  # interleaved, like prefill_rates
        ids = _ids(rng, n, vocab)
        r = on.generate(prompt_token_ids=ids, max_tokens=1)
        on_t.append(r.ttft_s + r.commit_s)
        off_t.append(off.generate(prompt_token_ids=ids, max_tokens=1).ttft_s)
    res.miss_on_s, res.miss_off_s = statistics.median(on_t), statistics.median(off_t)
    # Paired ratios: each on/off pair ran back to back on the same prompt, so load drifts cancel.
    res.overhead_paired = statistics.median(a / b for a, b in zip(on_t, off_t, strict=True)) - 1.0
    say(f"prefill throughput, {n} tokens: single pass vs {chunk}-token chunks")
    ids = _ids(rng, n, vocab)
    res.prefill_tokens = n
    res.single_pass_tps, res.chunked_tps = prefill_rates(runner, ids, chunk, repeats)
    say("decode throughput")
    r = off.generate(prompt_token_ids=_ids(rng, 32, vocab), max_tokens=33)
    res.decode_tps = (len(r.tokens) - 1) / r.decode_s if r.decode_s > 0 else 0.0
    say("hashing + lookup of a 50,000-token prompt")
    res.hash_lookup_ms = hash_lookup_ms(res.hash_tokens)
    on.close()
    off.close()
    return res


def markdown(res: BenchResult, command: str) -> str:
    lines = [
        "# Engine benchmark",
        "",
        f"`{command}` on {res.model}, {res.dtype}, {res.threads} threads, prefill chunk {res.prefill_chunk}, "
        f"tail {res.tail} tokens, median of {res.repeats} repeats.",
        "",
        "| prefix | cached | cold TTFT (s) | warm TTFT (s) | floor (s) | warm / floor (paired) | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.rows:
        lines.append(
            f"| {r.prefix} | {r.cached} | {r.cold_s:.3f} | {r.warm_s:.3f} | {r.floor_s:.3f} | "
            f"{r.warm_over_floor:.2f}x | {r.speedup:.1f}x |"
        )
    lines += [
        "",
        "| figure | value | target |",
        "|---|---:|---:|",
        f"| 0%-hit overhead vs cache off ({res.overhead_tokens} tokens, TTFT + commit, paired) | "
        f"{res.overhead_paired:+.1%} (medians {res.miss_on_s:.3f} s vs {res.miss_off_s:.3f} s) | <= 2% |",
        f"| single-pass prefill ({res.prefill_tokens} tokens) | {res.single_pass_tps:.0f} tok/s | |",
        f"| exact prefill ({res.prefill_chunk}-token chunks) | {res.chunked_tps:.0f} tok/s ({res.exact_ratio:.1%}) | >= 90% |",
        f"| decode | {res.decode_tps:.1f} tok/s | |",
        f"| hashing + lookup, {res.hash_tokens:,} tokens | {res.hash_lookup_ms:.2f} ms | <= 5 ms |",
        f"| KV bytes per token | {res.kv_bytes_per_token:,} | |",
        "",
        "![TTFT vs prefix length](engine_ttft.png)",
        "",
    ]
    return "\n".join(lines)


def plot(res: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.prefix for r in res.rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r.cold_s * 1e3 for r in res.rows], "o-", label="cold (miss)")
    ax.plot(xs, [r.warm_s * 1e3 for r in res.rows], "o-", label="warm (hit)")
    ax.plot(xs, [r.floor_s * 1e3 for r in res.rows], "--", color="gray", label="floor (tail over prebuilt KV)")
    ax.set_xlabel("cached prefix length (tokens), + 64-token tail")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{res.model}, {res.dtype}, {res.threads} threads, chunk {res.prefill_chunk}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(res: BenchResult, out_dir: Path, command: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png, cal = out_dir / "engine.md", out_dir / "engine_ttft.png", out_dir / "calibration.json"
    md.write_text(markdown(res, command))
    plot(res, png)
    data: dict[str, Any] = {
        "prefill_tps": round(res.chunked_tps, 1),  # the exact (chunked) cold prefill rate
        "decode_tps": round(res.decode_tps, 2),
        "kv_bytes_per_token": res.kv_bytes_per_token,
        "single_pass_tps": round(res.single_pass_tps, 1),
        "model": res.model,
        "dtype": res.dtype,
        "threads": res.threads,
        "prefill_chunk": res.prefill_chunk,
        "rows": [asdict(r) for r in res.rows],
        "miss_cache_on_s": round(res.miss_on_s, 4),
        "miss_cache_off_s": round(res.miss_off_s, 4),
        "overhead_paired": round(res.overhead_paired, 4),
        "hash_lookup_ms_50k": round(res.hash_lookup_ms, 3),
    }
    cal.write_text(json.dumps(data, indent=2) + "\n")
    return [md, png, cal]
