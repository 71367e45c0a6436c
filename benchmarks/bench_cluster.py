"""Routing policies across replicas: measured hit rate and TTFT beside the simulator's prediction.

    python benchmarks/bench_cluster.py [--replicas 3] [--tenants 4] [--per-tenant 6] [--shared-tier]
                                       [--capacity 24MB --kv-events]

Starts N real replicas (``prefixcache replica``, the embedded SmolLM2, no shared tier unless
``--shared-tier``), then for each policy runs the router in-process and replays one multi-tenant
shared-prefix trace through it: each tenant has its own long system prompt (and API key, so its
own salt), each request a short unique question; requests are interleaved in a seeded random
order and sent one at a time, streamed, ``max_tokens=1``. Each policy run gets fresh prefixes (a
run tag leads every system prompt), so runs do not warm each other.

Measured: hit rate = cached / prompt tokens (from the responses' usage), mean TTFT (client side:
send to the first content chunk). Predicted: the same requests, with their measured send times,
written as a trace and replayed by ``prefixcache.analysis.simulate`` with the same replica count
and routing. Writes ``benchmarks/results/cluster.md`` (and ``cluster.json``).

``--routers smg,vllm-router`` adds a row per external router (the binaries of
``pip install 'prefixcache[routers]'``: SMG ``cache_aware``, vllm-router ``kv_aware`` on the
replicas' KV events) over the same replicas; ``--clients N`` sends N requests at a time and
``--max-tokens`` sets the reply length. A second table gives every row's TTFT p50, output tok/s and
how evenly the replicas were loaded.

``--kv-events`` starts the replicas with KV events (``serve --kv-events-endpoint``) and adds a
``cache-aware + KV events`` row right after ``cache-aware``: the same trace through a router that
follows the replicas' events, in the same run; with a tight ``--capacity`` (per-replica memory
budget) replicas evict, which the plain record does not see.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_ext import EXTERNAL, SMG_KEY, external_front, p50, served, spread  # noqa: E402

from prefixcache.commands.cluster import free_port, wait_ready  # noqa: E402
from prefixcache.commands.server import parse_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "account",
    "billing",
    "invoice",
    "refund",
    "policy",
    "customer",
    "order",
    "shipping",
    "warranty",
    "return",
    "device",
    "battery",
    "screen",
    "network",
    "router",
    "password",
    "login",
    "session",
    "token",
    "quota",
    "limit",
    "upgrade",
    "plan",
    "contract",
    "region",
    "support",
    "agent",
    "escalate",
    "ticket",
    "priority",
    "response",
    "review",
    "compliance",
    "privacy",
    "export",
    "delete",
    "archive",
    "backup",
    "restore",
]


@dataclass(slots=True)
class Run:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_replica: dict[str, int] = field(default_factory=dict)
    failed: int = 0
    uncached_tokens: list[int] = field(default_factory=list)
    sent: list[tuple[float, dict[str, Any]]] = field(default_factory=list, repr=False)
    routing: str = ""  # the router policy (policy may be a label)
    shared_tier: bool = False
    sim_hit_rate: float | None = None
    sim_ttft_s: float | None = None  # default cost model
    sim_ttft_cal_s: float | None = None  # prefill rate calibrated on this benchmark's requests
    completion_tokens: int = 0
    wall_s: float = 0.0
    served: dict[str, int] = field(default_factory=dict)  # chat requests each replica answered
    external: bool = False  # SMG or vllm-router in front (no simulator prediction)

    @property
    def ttft_p50_s(self) -> float:
        return p50(self.ttft_s)

    @property
    def output_tps(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def spread(self) -> float:
        return spread(list(self.served.values()))

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else float("nan")


def system_prompt(rng: random.Random, tenant: str, tag: str, words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"[{tag}] You are the assistant of {tenant}. Follow the policy below exactly.\n{body}"


def build_requests(args: argparse.Namespace, tag: str) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)  # the same shape for every policy; only the tag differs
    tenants = [f"tenant-{chr(97 + i)}" for i in range(args.tenants)]
    systems = {t: system_prompt(rng, t, tag, args.system_words) for t in tenants}
    reqs = [
        {
            "tenant": t,
            "messages": [
                {"role": "system", "content": systems[t]},
                {
                    "role": "user",
                    "content": f"Question {j}: " + " ".join(rng.choice(WORDS) for _ in range(8)),
                },
            ],
        }
        for t in tenants
        for j in range(args.per_tenant)
    ]
    rng.shuffle(reqs)
    return reqs


EVENTS = "cache-aware + KV events"


class RouterThread:
    def __init__(self, urls: list[str], policy: str, feeds: dict[str, Any] | None = None) -> None:
        import uvicorn

        from prefixcache.router import RouterConfig, create_router_app

        self.port = free_port()
        app = create_router_app(RouterConfig(replicas=urls, policy=policy, kv_events=feeds or {}))
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def one_request(
    client: httpx.Client, model: str, req: dict[str, Any], max_tokens: int = 1, key: str | None = None
) -> tuple[float, int, int, str, int]:
    body = {
        "model": model,
        "messages": req["messages"],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key or 'key-' + req['tenant']}"},
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        replica = r.headers.get("x-prefixcache-replica", "?")
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None:
        ttft = time.perf_counter() - t0
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return ttft, int(usage.get("prompt_tokens", 0)), cached, replica, int(usage.get("completion_tokens", 0))


def fit_line(xs: list[int], ys: list[float]) -> tuple[float, float] | None:
    """(overhead seconds, tokens per second) of ``y = a + x / tps``; None if it cannot be fitted."""
    n = len(xs)
    if n < 3 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:
        return None
    return max(0.0, my - slope * mx), 1.0 / slope


def simulate(
    run: Run,
    replicas: int,
    align: int,
    tmp: Path,
    fit: tuple[float, float] | None,
    capacity: int | None = None,
) -> str:
    """The simulator's prediction for exactly the requests sent (same send times). Returns a note."""
    try:
        from prefixcache.analysis.costs import cost_model
        from prefixcache.analysis.simulate import SimConfig
        from prefixcache.analysis.simulate import simulate as sim
        from prefixcache.analysis.trace import load_trace
    except ImportError as e:  # the simulator is another team's module
        return f"simulator unavailable: {e}"
    if not run.sent:
        return "nothing sent"
    path = tmp / f"trace-{run.policy.replace(' ', '_')}.jsonl"
    with open(path, "w") as f:
        for ts, req in run.sent:
            f.write(
                json.dumps({"v": 1, "ts": ts, "tenant": req["tenant"], "messages": req["messages"]}) + "\n"
            )
    trace = load_trace(path, tokenizer="default")
    # A shared tier makes every replica see every prefix: predicted as one replica.
    budget = {"capacity_bytes": capacity} if capacity else {}  # else SimConfig's default
    cfg = SimConfig(
        **budget,
        replicas=1 if run.shared_tier else replicas,
        routing=run.routing,
        block_size=16,
        align_tokens=align,
        cost=cost_model(),
        pricing=(),
    )
    res = sim(trace, cfg)
    run.sim_hit_rate = res.hit_rate
    run.sim_ttft_s = float(res.ttft_s.mean())
    note = f"default cost model: prefill {cfg.cost.prefill_tps:.0f} tok/s ({cfg.cost.source})"
    if fit and not run.shared_tier:  # one simulated replica would queue what three served
        cfg.cost = cost_model(prefill_tps=fit[1])
        run.sim_ttft_cal_s = fit[0] + float(sim(trace, cfg).ttft_s.mean())
    return note


def start_replicas(
    n: int,
    keys_file: Path,
    env: dict[str, str],
    redis_url: str | None,
    logs: Path,
    chunk: int,
    extra: list[str] | None = None,
    feeds: dict[str, Any] | None = None,
) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """Start ``n`` replicas; with ``feeds`` (a dict to fill), each publishes KV events on loopback
    and ``feeds[url]`` says where."""
    from prefixcache.router.kv_index import FeedSpec

    urls, procs = [], []
    for i in range(n):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "prefixcache",
            "serve",
            "--port",
            str(port),
            "--api-keys",
            str(keys_file),
            "--log-level",
            "warning",
            "--prefill-chunk",
            str(chunk),
        ]
        if redis_url:
            cmd += ["--redis", redis_url]
        cmd += extra or []
        if feeds is not None:
            pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            cmd += ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
            feeds[f"http://127.0.0.1:{port}"] = FeedSpec(pub, replay)
        log = open(logs / f"replica-{i}.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    for url, p in zip(urls, procs, strict=True):
        wait_ready(url, p, 600)
    return urls, procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--per-tenant", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--policies", default="round-robin,prefix-affinity,cache-aware")
    ap.add_argument(
        "--shared-tier", action="store_true", help="also run round-robin over replicas sharing Redis"
    )
    ap.add_argument(
        "--shared-tier-modes", default="async,sync", help="Redis write modes to run with --shared-tier"
    )
    ap.add_argument("--align", type=int, default=128, help="the replicas' prefill chunk (hit granularity)")
    ap.add_argument("--model-name", default=None, help="model id to send (default: from GET /v1/models)")
    ap.add_argument(
        "--capacity", default=None, help="per-replica memory KV budget, e.g. 24MB (tight: evicts)"
    )
    ap.add_argument(
        "--kv-events",
        action="store_true",
        help="replicas publish KV events; adds a cache-aware row whose router follows them",
    )
    ap.add_argument(
        "--routers",
        default="",
        help="external routers to add rows for, comma-separated: smg (cache_aware), vllm-router (kv_aware on "
        "the replicas' KV events, which this turns on); from pip install 'prefixcache[routers]'",
    )
    ap.add_argument("--clients", type=int, default=1, help="requests in flight at once (1: one at a time)")
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request")
    ap.add_argument("--dtype", default=None, help="the replicas' --dtype (default: their own default)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cluster.md")
    args = ap.parse_args()
    externals = [r for r in args.routers.split(",") if r]
    for r in externals:
        if r not in EXTERNAL:
            ap.error(f"--routers: '{r}' is not one of {', '.join(EXTERNAL)}")
    if "vllm-router" in externals:
        args.kv_events = True  # its kv_aware policy follows the replicas' events

    tmp = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    keys_file = tmp / "keys.json"
    keys_file.write_text(
        json.dumps({f"key-tenant-{chr(97 + i)}": f"tenant-{chr(97 + i)}" for i in range(args.tenants)})
    )
    env = dict(
        os.environ,
        PREFIXCACHE_SALT_SECRET=secrets.token_hex(16),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
    )
    runs: list[Run] = []
    procs: list[subprocess.Popen[bytes]] = []
    t_start = time.time()
    try:
        feeds: dict[str, Any] | None = {} if args.kv_events else None
        budget = ["--capacity", args.capacity] if args.capacity else []
        budget += ["--dtype", args.dtype] if args.dtype else []
        urls, procs = start_replicas(args.replicas, keys_file, env, None, tmp, args.align, budget, feeds)
        model = (
            args.model_name
            or httpx.get(urls[0] + "/v1/models", headers={"authorization": "Bearer key-tenant-a"}).json()[
                "data"
            ][0]["id"]
        )
        policies = args.policies.split(",")
        if args.kv_events and EVENTS not in policies:  # right after the plain cache-aware row
            at = policies.index("cache-aware") + 1 if "cache-aware" in policies else len(policies)
            policies.insert(at, EVENTS)
        for policy in policies:
            if policy == EVENTS:
                runs.append(run_policy("cache-aware", urls, model, args, label=EVENTS, feeds=feeds))
            else:
                runs.append(run_policy(policy, urls, model, args))
        for name in externals:
            label = {"smg": "SMG cache_aware", "vllm-router": "vllm-router kv_aware"}[name]
            runs.append(run_policy(name, urls, model, args, label=label, feeds=feeds, external=name))
        if args.shared_tier:
            binary = shutil.which("redis-server")
            if binary is None:
                print("--shared-tier: redis-server not found; skipped", file=sys.stderr)
            else:
                stop(procs)
                rport = free_port()
                redis_proc = subprocess.Popen(
                    [binary, "--port", str(rport), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                    stdout=subprocess.DEVNULL,
                )
                procs = [redis_proc]
                time.sleep(0.5)
                for mode in args.shared_tier_modes.split(","):
                    extra = ["--redis-sync-writes"] if mode == "sync" else []
                    extra += budget
                    more_urls, more = start_replicas(
                        args.replicas, keys_file, env, f"redis://127.0.0.1:{rport}/0", tmp, args.align, extra
                    )
                    procs += more
                    label = f"round-robin + Redis tier ({mode} writes)"
                    runs.append(run_policy("round-robin", more_urls, model, args, label=label))
                    stop(more)
                    procs = [redis_proc]
    finally:
        stop(procs)
    # Calibrate on this machine, now: a least-squares line TTFT = a + uncached / tps over every
    # measured request; the prediction is then a + the simulator's TTFT at that tps (requests are
    # sequential, so the simulator's queueing adds nothing here).
    xs = [u for r in runs for u in r.uncached_tokens]
    ys = [t for r in runs for t in r.ttft_s]
    fit = fit_line(xs, ys)
    capacity = parse_bytes(args.capacity) if args.capacity else None
    notes = {simulate(r, args.replicas, args.align, tmp, fit, capacity) for r in runs if not r.external}
    if fit:
        notes.add(
            f"calibrated: TTFT = {fit[0] * 1000:.0f} ms + uncached tokens / {fit[1]:.0f} tok/s "
            "(least squares over this run's requests)"
        )
    write_report(runs, args, time.time() - t_start, sorted(notes))
    shutil.rmtree(tmp, ignore_errors=True)


def run_policy(
    policy: str,
    urls: list[str],
    model: str,
    args: argparse.Namespace,
    label: str | None = None,
    feeds: dict[str, Any] | None = None,
    external: str | None = None,
) -> Run:
    """One row: the trace (fresh prefixes) through the own router with ``policy``, or through
    ``external`` (smg, vllm-router) in front of the same replicas; ``args.clients`` at a time."""
    run = Run(
        policy=label or policy,
        routing=policy,
        shared_tier=label is not None and feeds is None and external is None,
        external=external is not None,
    )
    reqs = build_requests(args, tag=f"{run.policy}-{args.seed}")
    key = "key-tenant-a"
    before = served(urls, key)
    one_key = SMG_KEY if external == "smg" else None  # see cluster_ext.SMG_KEY
    if external:
        front: Any = external_front(external, urls, feeds, model, one_key)
    else:
        front = RouterThread(urls, policy, feeds)
    lock = threading.Lock()
    t0 = time.perf_counter()
    with front as base:
        t0 = time.perf_counter()

        def worker(mine: list[dict[str, Any]]) -> None:
            with httpx.Client(base_url=base, timeout=600) as client:
                for req in mine:
                    ts = time.perf_counter() - t0
                    try:
                        ttft, prompt, cached, replica, completion = one_request(
                            client, model, req, args.max_tokens, one_key
                        )
                    except (httpx.HTTPError, RuntimeError) as e:
                        print(f"{run.policy}: request failed: {e}", file=sys.stderr)
                        with lock:
                            run.failed += 1
                        continue
                    with lock:
                        run.sent.append((ts, req))
                        run.requests += 1
                        run.prompt_tokens += prompt
                        run.cached_tokens += cached
                        run.completion_tokens += completion
                        run.uncached_tokens.append(prompt - cached)
                        run.ttft_s.append(ttft)
                        run.per_replica[replica] = run.per_replica.get(replica, 0) + 1

        threads = [
            threading.Thread(target=worker, args=(reqs[c :: args.clients],)) for c in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        run.wall_s = time.perf_counter() - t0
    after = served(urls, key)
    run.served = {u: after[u] - before[u] for u in urls}
    run.sent.sort(key=lambda x: x[0])
    print(
        f"{run.policy:28s} hit {run.hit_rate:6.1%}  TTFT p50 {run.ttft_p50_s * 1000:7.0f} ms  "
        f"{run.output_tps:6.1f} tok/s  served {sorted(run.served.values())}  failed {run.failed}",
        flush=True,
    )
    return run


def write_report(runs: list[Run], args: argparse.Namespace, elapsed: float, notes: list[str]) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    cmd = (
        f"python benchmarks/bench_cluster.py --replicas {args.replicas} --tenants {args.tenants} "
        f"--per-tenant {args.per_tenant} --system-words {args.system_words} --align {args.align}"
        + (f" --capacity {args.capacity}" if args.capacity else "")
        + (" --kv-events" if args.kv_events else "")
        + (f" --shared-tier --shared-tier-modes {args.shared_tier_modes}" if args.shared_tier else "")
        + (f" --routers {args.routers}" if args.routers else "")
        + (f" --clients {args.clients}" if args.clients != 1 else "")
        + (f" --max-tokens {args.max_tokens}" if args.max_tokens != 1 else "")
        + (f" --dtype {args.dtype}" if args.dtype else "")
    )
    dtype = args.dtype or "the replicas' default dtype"
    lines = [
        "# Cluster routing benchmark",
        "",
        f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs shared with "
        f"other work, load average {os.getloadavg()[0]:.1f} at the end; {elapsed:.0f} s in all).",
        "",
        f"{args.replicas} replicas of the embedded SmolLM2-135M ({dtype}, "
        f"prefill chunk {args.align}: the "
        f"hit granularity), {args.tenants} tenants (own API key, so own salt; own ~{args.system_words}-word "
        f"system prompt), {args.per_tenant} requests per tenant with a unique question, interleaved in a "
        f"seeded random order and sent {args.clients} at a time through the router (streamed, "
        f"max_tokens={args.max_tokens}). Each row "
        "uses fresh prefixes. Measured: hit rate = cached / prompt tokens from the responses' usage; TTFT "
        "client side, send to first content chunk. Predicted: the same requests at the same send times "
        "replayed by `prefixcache.analysis.simulate` with the same replica count and routing (the "
        "shared-tier row as one replica, since every replica reads every prefix from Redis).",
        "",
        "| routing | requests | hit rate measured | hit rate predicted | mean TTFT measured "
        "| predicted (default cost) | predicted (calibrated) | requests per replica | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        counts = r.served.values() if r.served else r.per_replica.values()
        per = ", ".join(str(v) for v in sorted(counts, reverse=True))
        lines.append(
            f"| {r.policy} | {r.requests} | {pct(r.hit_rate)} | {pct(r.sim_hit_rate)} | {ms(r.mean_ttft_s)} "
            f"| {ms(r.sim_ttft_s)} | {ms(r.sim_ttft_cal_s)} | {per} | {r.failed} |"
        )
    if notes:
        lines += ["", "Simulator cost models: " + "; ".join(notes) + "."]
    if args.clients > 1:
        lines += [
            "",
            f"With {args.clients} requests in flight the predictions fall below the measured hit rates; the "
            "replay was calibrated on one-at-a-time runs, and how it orders requests sent together (and "
            "what each then finds cached) is not checked here. Compare the measured rows with each other.",
        ]
    if any(r.external for r in runs):
        lines += [
            "",
            "SMG and vllm-router rows: the same replicas and trace shape (fresh prefixes), the router "
            "binary from `pip install 'prefixcache[routers]'` in front; no prediction (the simulator "
            "routes as the own router does). SMG runs as one tenant: it reads a replica's model from "
            "`GET /v1/models` with the key given by `--api-key` and then requires that key of every "
            "client, so all its requests use tenant a's key (the tenants' system prompts differ, so no "
            "row shares a prefix across tenants). vllm-router forwards each client's key.",
        ]
    lines += [
        "",
        "Every row on the same replicas: requests each replica answered (from the replicas' own "
        "`prefixcache_requests_total`), load spread = the busiest replica's requests over the mean "
        "(1.00 is even), TTFT p50 client side, output tok/s = completion tokens over the row's wall time.",
        "",
        "| routing | hit rate | TTFT p50 | output tok/s | served per replica | load spread | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        per = ", ".join(str(v) for v in sorted(r.served.values(), reverse=True))
        lines.append(
            f"| {r.policy} | {pct(r.hit_rate)} | {ms(r.ttft_p50_s)} | {r.output_tps:.1f} | {per} "
            f"| {r.spread:.2f} | {r.failed} |"
        )
    lines += [
        "",
        "Reading it: the hit-rate predictions replay the same PrefixCache code, so for the routing rows "
        "they should agree to the token; a gap on an async shared-tier row is the asynchronous "
        "write-through (a request reaching another replica before the previous one's blocks land in Redis "
        "recomputes), which the one-replica prediction does not model; synchronous writes close it. The "
        "calibrated TTFT is not given for the shared-tier rows: one simulated replica would queue what "
        "three replicas served. Rendezvous hashing of 4 tenants over 3 replicas can put several tenants on "
        "one replica (see requests per replica); the load guard only steps in when in-flight counts "
        "diverge. Measured TTFT on a shared, loaded CPU is dominated by contention; compare rows with each "
        "other, not with the default cost model.",
    ]
    if args.kv_events:
        lines += [
            "",
            f"The `{EVENTS}` row routes the same trace (fresh prefixes) over the same replicas with a "
            "router that follows their KV events (BlockStored / BlockRemoved): a prefix a replica evicted "
            "no longer attracts requests to it, and a prefix nobody holds goes to the least-loaded "
            "replica. Its prediction is the simulator's plain cache-aware routing (the simulator has no "
            "events). "
            + (f"Per-replica memory budget: {args.capacity}." if args.capacity else "Default budget."),
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    rows = []
    for r in runs:
        d = asdict(r)
        d.pop("sent")
        rows.append(
            d
            | {
                "hit_rate": r.hit_rate,
                "mean_ttft_s": r.mean_ttft_s,
                "ttft_p50_s": r.ttft_p50_s,
                "output_tps": r.output_tps,
                "spread": r.spread,
            }
        )
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
