"""``prefixcache bench``: cold, warm and floor TTFT, 0%-hit overhead, exact vs single-pass
prefill, decode, hashing + lookup of a long prompt, for each runner (the own Llama runner and the
Hugging Face one) in one run. Ratios are measured within one run; medians of repeats.

- cold: prefix + tail, nothing cached (a fresh random prefix per repeat).
- warm: the same prefix with another tail, after the cold request stored it.
- floor: the tail alone computed over the prefix's KV prepared beforehand (HF: a prebuilt
  DynamicCache; own runner: the prefix prefilled into pool blocks), no cache layer, no
  admission: the least a hit can cost.
- exact prefill: HF, absolute ``prefill_chunk`` chunks (its exactness scheme); own runner, steps
  of ``prefill_chunk`` tokens (any chunking is exact). Against one pass over the whole prompt.
- own runner only: cold prefill with torch's SDPA in place of the invariant attention (what
  invariance costs).
- with a llama.cpp peer (``--llamacpp-python``): its one-pass prefill and decode, each measured
  in turn with the first runner's on the same tokens (``engine/bench_peer.py``).
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
from prefixcache.engine.bench_peer import LlamaCppPeer
from prefixcache.engine.engine import Engine, chunk_schedule
from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.model import ModelRunner
from prefixcache.engine.serving import kv

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
    runner: str  # "llama" (own) or "hf"
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
    sdpa_tps: float = 0.0  # own runner: single-pass prefill with SDPA attention (not invariant)
    weights: str = ""  # "q4_1" where the 4-bit weights are read in place, else the dtype

    @property
    def exact_ratio(self) -> float:
        return self.chunked_tps / self.single_pass_tps


#: Decode tokens timed per generation (after the first, which the prefill makes): a generation of
#: 32 tokens on a shared 2-core host read anywhere from 0.6x to 1.1x of a longer one's rate.
DECODE_TOKENS = 128


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ordinary vocabulary range (skips the low ids where special tokens live).
    return [rng.randrange(100, vocab) for _ in range(n)]


class _Prefill:
    """Cold prefills outside any engine: ``run(ids, spans)`` returns seconds (the KV is dropped),
    ``prefix(ids)`` returns the prefix's KV ready for a tail (a DynamicCache or a block table)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.own = isinstance(runner, LlamaRunner)
        self.pool = runner.new_pool(4096 // 16 * 2 + 64) if isinstance(runner, LlamaRunner) else None

    def _table(self, n: int) -> list[Any]:
        assert self.pool is not None
        return [self.pool.alloc() for _ in range(-(-n // self.pool.block_size))]

    def forward(self, ids: Sequence[int], start: int, state: Any) -> None:
        if isinstance(self.runner, LlamaRunner):
            assert self.pool is not None
            self.runner.step(self.pool, [Segment(ids, start, [b.index for b in state], want_logits=True)])
        else:
            self.runner.forward(ids, state)

    def new_state(self, n: int) -> Any:
        return self._table(n) if self.own else self.runner.new_cache()

    def drop(self, state: Any) -> None:
        """Give a state's pool blocks back (the pool frees explicitly); a DynamicCache just goes."""
        if self.own:
            assert self.pool is not None
            self.pool.free_all(state)

    def run(self, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> float:
        state = self.new_state(len(ids))
        t = time.perf_counter()
        for a, b in spans:
            self.forward(ids[a:b], a, state)
        elapsed = time.perf_counter() - t
        self.drop(state)
        return elapsed


def prefill_rates(runner: ModelRunner, ids: Sequence[int], chunk: int, repeats: int) -> tuple[float, float]:
    """Tokens/s of a cold prefill of ``ids``: (one forward pass, ``chunk``-token chunks: absolute
    ones for the HF runner, engine steps for the own runner).

    The two are interleaved repeat by repeat, so a change in machine load hits both alike.
    """
    schedules = ([(0, len(ids))], chunk_schedule(0, len(ids), chunk))
    prefill = _Prefill(runner)

    def once(spans: list[tuple[int, int]]) -> float:
        return prefill.run(ids, spans)

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


def _prefix_kv(engine: Engine, prefix: list[int], tail: list[int], prefill: _Prefill) -> Any:
    """The prefix's KV, ready for the tail. HF: a DynamicCache from the engine's cache when it
    holds all of it (the cold request stored it), else prefilled on the same chunk schedule.
    Own runner: the prefix prefilled into pool blocks of ``prefill`` (the table, with room)."""
    runner, n = engine.runner, len(prefix)
    if prefill.own:
        state = prefill.new_state(n + len(tail))
        for a, b in chunk_schedule(0, n, engine.prefill_chunk):
            prefill.forward(prefix[a:b], a, state)
        return state
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
    kind: str = "auto",
    lengths: Sequence[int] = (256, 512, 1024, 1536, 2048),
    tail: int = 64,
    repeats: int = 3,
    prefill_chunk: int | None = None,
    progress: Progress | None = None,
    seed: int = 0,
    peer: LlamaCppPeer | None = None,
) -> BenchResult:
    """Measure one runner (``kind``: auto, llama or hf, as ``Engine(runner=...)``). ``peer``: a
    running llama.cpp, measured in turn with this runner's one-pass prefill and decode (its
    figures stay in the peer: ``peer.result()``)."""
    rng = random.Random(seed)
    vocab = min(runner.vocab_size, 40_000)
    on = Engine(runner, prefill_chunk=prefill_chunk, runner=kind)
    off = Engine(runner, prefill_chunk=on.prefill_chunk, enable_cache=False, runner=kind)
    runner = on.runner
    label = "llama" if on.batched else "hf"

    def say(msg: str) -> None:
        if progress is not None:
            progress(f"[{label}] {msg}")

    chunk = on.prefill_chunk
    on.generate(prompt_token_ids=_ids(rng, 64, vocab), max_tokens=1)  # warm-up; starts the worker
    # Everything computed outside the engines runs on `on`'s worker thread, and `off` is closed
    # before the figures that follow it: one OpenMP pool at a time (docs/engine.md, Threads).
    prefill = on.run_on_worker(lambda: _Prefill(runner))
    res = BenchResult(runner.name, label, runner.dtype_name, runner.threads, chunk, tail, repeats)
    res.weights = getattr(runner, "weights_format", runner.dtype_name)
    res.kv_bytes_per_token = (
        2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * runner.dtype.itemsize
    )
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

            def timed_floor(prefix: list[int] = prefix, tail_ids: list[int] = tail_ids, n: int = n) -> float:
                fresh = _prefix_kv(on, prefix, tail_ids, prefill)
                t = time.perf_counter()
                prefill.forward(tail_ids, n, fresh)
                elapsed = time.perf_counter() - t
                prefill.drop(fresh)
                return elapsed

            floor.append(on.run_on_worker(timed_floor))
        paired = statistics.median(w / f for w, f in zip(warm, floor, strict=True))
        res.rows.append(
            TtftRow(
                n, cached, statistics.median(cold), statistics.median(warm), statistics.median(floor), paired
            )
        )
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
    off.close()
    say(f"prefill throughput, {n} tokens: single pass vs {chunk}-token chunks")
    ids = _ids(rng, n, vocab)
    res.prefill_tokens = n
    res.single_pass_tps, res.chunked_tps = on.run_on_worker(
        lambda: prefill_rates(runner, ids, chunk, repeats)
    )
    if isinstance(runner, LlamaRunner):
        say(f"prefill throughput, {n} tokens: invariant attention vs SDPA")

        def against_sdpa() -> tuple[list[float], list[float]]:
            sdpa = _Prefill(runner.with_attention("sdpa"))
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(repeats):  # interleaved, with the peer's pass on the same ids
                times[0].append(prefill.run(ids, [(0, n)]))
                times[1].append(sdpa.run(ids, [(0, n)]))
                if peer is not None:
                    peer.prefill(ids)
            return times

        times = on.run_on_worker(against_sdpa)
        res.single_pass_tps = n / statistics.median(times[0])
        res.sdpa_tps = n / statistics.median(times[1])
    elif peer is not None:
        for _ in range(repeats):
            peer.prefill(ids)
    with_peer = " in turn with llama.cpp's" if peer is not None and not peer.skipped else ""
    say(f"decode throughput, {repeats} generations of {DECODE_TOKENS} tokens{with_peer}")
    rates = []
    for _ in range(repeats):  # each a miss: a fresh 32-token prompt of random ids
        prompt = _ids(rng, 32, vocab)
        r = on.generate(prompt_token_ids=prompt, max_tokens=DECODE_TOKENS + 1)
        if r.decode_s > 0 and len(r.tokens) > 1:  # timed from the first token (the prefill's) on
            rates.append((len(r.tokens) - 1) / r.decode_s)
        if peer is not None:  # then the peer, on the same prompt
            peer.decode(prompt, DECODE_TOKENS + 1)
    res.decode_tps = statistics.median(rates) if rates else 0.0
    say("hashing + lookup of a 50,000-token prompt")
    res.hash_lookup_ms = hash_lookup_ms(res.hash_tokens)
    on.close()
    return res


def _section(res: BenchResult) -> list[str]:
    exact = "absolute chunks" if res.runner == "hf" else "engine steps"
    lines = [
        f"## {res.runner} runner ({res.dtype}, weights {res.weights})",
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
        f"| exact prefill ({res.prefill_chunk}-token {exact}) "
        f"| {res.chunked_tps:.0f} tok/s ({res.exact_ratio:.1%}) "
        "| >= 90% |",
    ]
    if res.sdpa_tps:
        lines.append(
            f"| single-pass prefill with SDPA attention (not invariant) | {res.sdpa_tps:.0f} tok/s "
            f"(invariant attention costs {res.sdpa_tps / res.single_pass_tps - 1:+.1%}) | <= 10% |"
        )
    lines += [
        f"| decode, one stream | {res.decode_tps:.1f} tok/s | |",
        f"| hashing + lookup, {res.hash_tokens:,} tokens | {res.hash_lookup_ms:.2f} ms | <= 5 ms |",
        f"| KV bytes per token | {res.kv_bytes_per_token:,} | |",
        "",
    ]
    return lines


def markdown(results: Sequence[BenchResult], command: str) -> str:
    first = results[0]
    lines = [
        "# Engine benchmark",
        "",
        f"`{command}` on {first.model}, {first.threads} threads, prefill chunk {first.prefill_chunk}, "
        f"tail {first.tail} tokens, median of {first.repeats} repeats; runners measured one after the other "
        "in the same run.",
        "",
    ]
    own = next((r for r in results if r.runner == "llama"), None)
    hf = next((r for r in results if r.runner == "hf"), None)
    if own is not None and hf is not None:
        last_own, last_hf = own.rows[-1], hf.rows[-1]
        lines += [
            "## Own runner against the 0.1 (Hugging Face) runner",
            "",
            "| figure | own | HF | ratio | target |",
            "|---|---:|---:|---:|---:|",
            f"| decode, one stream (tok/s) | {own.decode_tps:.1f} | {hf.decode_tps:.1f} | "
            f"{own.decode_tps / hf.decode_tps:.2f}x | >= 3.5x |",
            f"| cold prefill, {own.prefill_tokens} tokens, one pass (tok/s) | {own.single_pass_tps:.0f} | "
            f"{hf.single_pass_tps:.0f} | {own.single_pass_tps / hf.single_pass_tps:.2f}x | >= 2.4x |",
            f"| warm TTFT, {last_own.prefix} prefix (s) | {last_own.warm_s:.3f} | {last_hf.warm_s:.3f} | "
            f"{last_hf.warm_s / last_own.warm_s:.2f}x faster | |",
            f"| warm / floor at {last_own.prefix} | {last_own.warm_over_floor:.2f}x "
            f"| {last_hf.warm_over_floor:.2f}x "
            "| | <= 1.1x |",
            f"| tokens read from the cache, prefixes {', '.join(str(r.prefix) for r in own.rows)} | "
            f"{sum(r.cached for r in own.rows):,} | {sum(r.cached for r in hf.rows):,} | | |",
            "",
        ]
    for res in results:
        lines += _section(res)
    lines += ["![TTFT vs prefix length](engine_ttft.png)", ""]
    return "\n".join(lines)


def plot(results: Sequence[BenchResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res, color in zip(results, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        xs = [r.prefix for r in res.rows]
        ax.plot(xs, [r.cold_s * 1e3 for r in res.rows], "o-", color=color, label=f"{res.runner}: cold (miss)")
        ax.plot(
            xs,
            [r.warm_s * 1e3 for r in res.rows],
            "s-",
            color=color,
            alpha=0.6,
            label=f"{res.runner}: warm (hit)",
        )
        ax.plot(xs, [r.floor_s * 1e3 for r in res.rows], ":", color=color, label=f"{res.runner}: floor")
    first = results[0]
    ax.set_xlabel(f"cached prefix length (tokens), + {first.tail}-token tail")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{first.model}, {first.threads} threads: own runner vs Hugging Face runner")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(results: Sequence[BenchResult], out_dir: Path, command: str) -> list[Path]:
    """engine.md, engine_ttft.png and calibration.json (the simulator reads the first runner's
    ``prefill_tps``: the runner served by default)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png, cal = out_dir / "engine.md", out_dir / "engine_ttft.png", out_dir / "calibration.json"
    md.write_text(markdown(results, command))
    plot(results, png)
    res = results[0]
    data: dict[str, Any] = {
        "prefill_tps": round(res.chunked_tps, 1),  # the exact (chunked) cold prefill rate
        "decode_tps": round(res.decode_tps, 2),
        "kv_bytes_per_token": res.kv_bytes_per_token,
        "single_pass_tps": round(res.single_pass_tps, 1),
        "model": res.model,
        "runner": res.runner,
        "dtype": res.dtype,
        "weights": res.weights,
        "threads": res.threads,
        "prefill_chunk": res.prefill_chunk,
        "rows": [asdict(r) for r in res.rows],
        "miss_cache_on_s": round(res.miss_on_s, 4),
        "miss_cache_off_s": round(res.miss_off_s, 4),
        "overhead_paired": round(res.overhead_paired, 4),
        "hash_lookup_ms_50k": round(res.hash_lookup_ms, 3),
        "runners": [asdict(r) for r in results],
    }
    cal.write_text(json.dumps(data, indent=2) + "\n")
    return [md, png, cal]
