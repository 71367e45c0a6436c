"""Soak: mixed valid and invalid traffic from several tenants through the router to two replicas
sharing a Redis tier, while Redis and then one replica are killed and restarted.

    python benchmarks/soak.py [--duration 180] [--workers 4] [--tenants 3] [--capacity 32MiB]

Minutes, not part of ``make test``. Starts a password-protected, capped redis-server (as
``prefixcache cluster`` does), two ``prefixcache serve`` replicas of the embedded SmolLM2 (API
keys, one salt secret, a small memory budget so that eviction runs), the router in-process, and
a cache-off reference server in-process (the same server code over an engine without a cache).
Workers send greedy chat completions (streamed or not) of a fixed prompt pool, and invalid
requests (lone surrogates, deep nesting, oversized bodies, a wrong key, bad parameters, broken
JSON, and hostile structure: an unterminated string of escaped quotes, a backslash run, 60,000
empty objects). A flusher sends ``DELETE /v1/cache`` as a random tenant every 6 s, and the
router's ``/health`` latency is sampled four times a second. A prober sends a fresh prompt as
one tenant, then as another: the second must read 0 cached tokens. The chaos schedule
(fractions of ``--duration``): Redis killed at 0.2, restarted empty at 0.35; replica 1 killed
(SIGKILL) at 0.5, restarted at 0.65.

Reported (and written to ``benchmarks/results/soak.md``): requests served; 5xx and broken
streams, each classified as in flight on a killed replica or not (only the first kind may
occur); invalid requests answered 4xx (never 5xx); answers that differ from the cache-off
reference (must be 0); the largest ``prefixcache_cache_bytes`` each replica reported against its
byte budget (within +5%); cross-tenant hits (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# The in-process reference must run the same engine as the replicas, which get PYTHONPATH=ROOT/src:
# without this, `prefixcache` here is whatever the interpreter finds first (an editable install of
# another checkout), and a reference of another kernel set answers otherwise for a few prompts.
sys.path.insert(0, str(ROOT / "src"))
MODEL = "smollm2-135m-instruct"
TOPICS = ["a bicycle shop", "a mountain hotel", "a city library", "a bakery", "a ferry line"]
QUESTIONS = ["When do you open?", "Where are you?", "Can I pay by card?", "Do you deliver?"]


def system_prompt(topic: str) -> str:
    return (f"You are the assistant of {topic}. Answer in one short sentence. " * 3) + (
        "Be precise, friendly and brief; never invent opening hours or prices. " * 6
    )


@dataclass(slots=True)
class Outcome:
    kind: str  # "valid" | "invalid" | "probe"
    start: float
    end: float
    status: int
    replica: str = ""
    broken: bool = False
    answer: str = ""
    prompt: tuple[str, str] = ("", "")
    cached: int = 0
    tenant: str = ""


@dataclass(slots=True)
class Soak:
    args: argparse.Namespace
    router_url: str
    keys: list[str]
    ref_url: str
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (t, what, replica url)
    max_bytes: dict[str, int] = field(default_factory=dict)
    reference: dict[tuple[str, str], str] = field(default_factory=dict)
    runtime: str = ""  # the compute line the reference and every replica share
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    health_s: list[float] = field(default_factory=list)  # the router's /health latencies

    def body(self, prompt: tuple[str, str], stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "system", "content": prompt[0]}, {"role": "user", "content": prompt[1]}],
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    def chat(self, c: httpx.Client, key: str, prompt: tuple[str, str], stream: bool, kind: str) -> Outcome:
        t0 = time.monotonic()
        out = Outcome(kind, t0, t0, 0, prompt=prompt, tenant=key)
        headers = {"authorization": f"Bearer {key}"}
        try:
            if not stream:
                r = c.post("/v1/chat/completions", json=self.body(prompt, False), headers=headers)
                out.status, out.replica = r.status_code, r.headers.get("x-prefixcache-replica", "")
                if r.status_code == 200:
                    data = r.json()
                    out.answer = data["choices"][0]["message"]["content"] or ""
                    out.cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            else:
                with c.stream(
                    "POST", "/v1/chat/completions", json=self.body(prompt, True), headers=headers
                ) as r:
                    out.status, out.replica = r.status_code, r.headers.get("x-prefixcache-replica", "")
                    done, parts = False, []
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        event = json.loads(line[5:])
                        if "error" in event:
                            out.broken = True
                        for choice in event.get("choices") or []:
                            parts.append(choice.get("delta", {}).get("content") or "")
                        if event.get("usage"):
                            out.cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                    out.answer = "".join(parts)
                    out.broken = out.broken or (r.status_code == 200 and not done)
        except httpx.HTTPError:
            out.status, out.broken = 0, True  # the router itself failed us: counted as unexplained
        out.end = time.monotonic()
        return out

    def invalid(self, c: httpx.Client, rng: random.Random) -> Outcome:
        key = rng.choice(self.keys)
        good = self.body(("x", "y"), False)
        cases: list[tuple[str, Any]] = [
            ("surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'),
            ("deep", b'{"model": "m", "messages": ' + b"[" * 200 + b"]" * 200 + b"}"),
            ("too large", json.dumps({**good, "messages": [{"role": "user", "content": "x" * 300_000}]})),
            ("malformed", b'{"model": "m", "messages": ['),
            ("wrong model", json.dumps({**good, "model": "gpt-17"})),
            ("bad max_tokens", json.dumps({**good, "max_tokens": -3})),
            ("negative temperature", json.dumps({**good, "temperature": -1})),
            ("huge seed", json.dumps({**good, "seed": 2**64})),
            ("no messages", json.dumps({**good, "messages": []})),
            # Hostile structure (issue 21): quadratic for a backtracking string regex, costly to
            # parse or validate; each must be a quick 4xx while /health keeps answering.
            ("escaped quotes", b"[" * 65 + b'"' + b'\\"' * 70_000),
            ("backslash run", b'{"model": "m", "messages": [{"content": "' + b"\\" * 200_000),
            ("many objects", b'{"model": "m", "messages": [' + b"{}," * 60_000 + b"{}]}"),
        ]
        case, content = rng.choice(cases)
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        if rng.random() < 0.15:
            headers["authorization"] = "Bearer sk-not-a-key-of-this-deployment"
            case += ", wrong key"
        t0 = time.monotonic()
        try:
            r = c.post("/v1/chat/completions", content=content, headers=headers)
            status, replica = r.status_code, r.headers.get("x-prefixcache-replica", "")
        except httpx.HTTPError:
            status, replica = 0, ""
        return Outcome("invalid", t0, time.monotonic(), status, replica, prompt=(case, ""))

    def flusher(self) -> None:
        """A tenant flushing its cache every few seconds (DELETE /v1/cache through the router)."""
        rng = random.Random(7)
        with httpx.Client(base_url=self.router_url, timeout=300) as c:
            while self.args.flush_every > 0 and not self.stop.wait(self.args.flush_every):
                t0 = time.monotonic()
                try:
                    key = rng.choice(self.keys)
                    r = c.delete("/v1/cache", headers={"authorization": f"Bearer {key}"})
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                with self.lock:
                    self.outcomes.append(Outcome("flush", t0, time.monotonic(), status))

    def health(self) -> None:
        """The router's /health latency, four times a second."""
        with httpx.Client(base_url=self.router_url, timeout=30) as c:
            while not self.stop.wait(0.25):
                t0 = time.monotonic()
                try:
                    c.get("/health")
                except httpx.HTTPError:
                    continue
                self.health_s.append(time.monotonic() - t0)

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.router_url, timeout=300) as c:
            while not self.stop.is_set():
                if rng.random() < self.args.invalid_share:
                    out = self.invalid(c, rng)
                else:
                    prompt = (system_prompt(rng.choice(TOPICS)), rng.choice(QUESTIONS))
                    out = self.chat(c, rng.choice(self.keys), prompt, rng.random() < 0.5, "valid")
                with self.lock:
                    self.outcomes.append(out)

    def prober(self) -> None:
        """A fresh prompt as tenant A, then the same as tenant B: B must read nothing."""
        n = 0
        with httpx.Client(base_url=self.router_url, timeout=300) as c:
            while not self.stop.wait(5.0):
                n += 1
                a, b = random.Random(n).sample(self.keys, 2)
                prompt = (
                    f"[probe {n} {os.urandom(4).hex()}] " + system_prompt(TOPICS[n % len(TOPICS)]),
                    "Hi",
                )
                first = self.chat(c, a, prompt, False, "probe-first")
                second = self.chat(c, b, prompt, n % 2 == 0, "probe")
                with self.lock:
                    self.outcomes += [first, second]

    def monitor(self, replicas: list[str]) -> None:
        with httpx.Client(timeout=5) as c:
            while not self.stop.wait(1.0):
                for url in replicas:
                    try:
                        text = c.get(url + "/metrics").text
                    except httpx.HTTPError:
                        continue
                    for line in text.splitlines():
                        if line.startswith("prefixcache_cache_bytes "):
                            value = int(float(line.split()[1]))
                            self.max_bytes[url] = max(self.max_bytes.get(url, 0), value)

    def reference_answer(self, prompt: tuple[str, str]) -> str:
        if prompt not in self.reference:
            r = httpx.post(self.ref_url + "/v1/chat/completions", json=self.body(prompt, False), timeout=600)
            r.raise_for_status()
            self.reference[prompt] = r.json()["choices"][0]["message"]["content"] or ""
        return self.reference[prompt]


# ---------------------------------------------------------------------------- processes
def start_replica(
    port: int, env: dict[str, str], keys: Path, capacity: str, log: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "prefixcache", "serve", "--port", str(port), "--api-keys", str(keys)]
    cmd += ["--capacity", capacity, "--threads", "1", "--log-level", "warning"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def back_up(soak: Soak, url: str, proc: subprocess.Popen[bytes]) -> None:
    """Note when a restarted replica answers /health again (the router's next health round
    puts it back in rotation)."""
    from prefixcache.commands.cluster import wait_ready

    try:
        wait_ready(url, proc, 600)
    except RuntimeError:
        return
    with soak.lock:
        soak.events.append((time.monotonic(), "replica healthy again", url))


def same_runtime(reference: str, logs: list[Path]) -> str:
    """The compute line (runner, dtype, weights, threads, kernels) of the reference, after
    checking that every replica's log prints the same one: answers are compared only between
    engines of one kernel set (exactness holds within one, not across them)."""
    import prefixcache

    if not Path(prefixcache.__file__).resolve().is_relative_to(ROOT / "src"):
        sys.exit(f"the reference imports prefixcache from {prefixcache.__file__}, not {ROOT / 'src'}")
    for log in logs:
        lines = [line for line in log.read_text().splitlines() if line.startswith("prefixcache: compute: ")]
        line = lines[-1].removeprefix("prefixcache: compute: ") if lines else "(no compute line)"
        if line != reference:
            sys.exit(f"{log.name} computes with '{line}', the reference with '{reference}': not comparable")
    return reference


def serve_in_thread(app: Any, port: int) -> Any:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def main() -> None:  # noqa: PLR0915 - one linear script: set up, run, classify, report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of traffic (default 180)")
    ap.add_argument("--workers", type=int, default=4, help="concurrent client threads")
    ap.add_argument("--tenants", type=int, default=3, help="tenants, one API key each")
    ap.add_argument("--capacity", default="32MiB", help="each replica's memory KV budget")
    ap.add_argument("--invalid-share", type=float, default=0.3, help="share of invalid requests")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--flush-every", type=float, default=6.0, help="seconds between two DELETE /v1/cache (0: none)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/soak.md")
    args = ap.parse_args()

    from prefixcache.commands.cluster import wait_ready
    from prefixcache.commands.redis_process import free_port, redis_password_from, start_redis
    from prefixcache.commands.server import parse_bytes
    from prefixcache.engine import Engine
    from prefixcache.engine.runtime import describe_runtime
    from prefixcache.router import RouterConfig, create_router_app
    from prefixcache.server import create_app

    tmp = Path(tempfile.mkdtemp(prefix="prefixcache-soak-"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    reference: Engine | None = None
    t_start = time.time()
    try:
        keys = {f"sk-soak-tenant-{i}-{os.urandom(8).hex()}": f"tenant-{i}" for i in range(args.tenants)}
        (tmp / "keys.json").write_text(json.dumps(keys))
        password = redis_password_from(None)
        binary = shutil.which("redis-server") or sys.exit("redis-server is not on PATH")
        redis_port = free_port()
        redis_opts = {
            "maxmemory": 256 << 20,
            "policy": "allkeys-lru",
            "password": password,
            "port": redis_port,
        }
        procs["redis"], redis_url = start_redis(binary, str(tmp), **redis_opts)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "PREFIXCACHE_SALT_SECRET": os.urandom(16).hex(),
            "PREFIXCACHE_REDIS_URL": redis_url,
            "OMP_NUM_THREADS": "1",
        }
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for i, p in enumerate(ports):
            procs[urls[i]] = start_replica(p, env, tmp / "keys.json", args.capacity, tmp / f"replica-{i}.log")
        print("loading the reference engine and two replicas ...", flush=True)
        ref_port = free_port()
        reference = Engine(None, enable_cache=False, threads=1)
        serve_in_thread(create_app(reference, model_name=MODEL), ref_port)
        for url in urls:
            wait_ready(url, procs[url], 600)
        runtime = same_runtime(describe_runtime(reference), [tmp / f"replica-{i}.log" for i in range(2)])
        config = RouterConfig(urls, policy="cache-aware", health_interval_s=0.5, max_body_bytes=256 << 10)
        router_port = free_port()
        serve_in_thread(create_router_app(config), router_port)
        soak = Soak(args, f"http://127.0.0.1:{router_port}", list(keys), f"http://127.0.0.1:{ref_port}")
        soak.runtime = runtime
        print("reference answers of the prompt pool ...", flush=True)
        for topic in TOPICS:
            for q in QUESTIONS:
                soak.reference_answer((system_prompt(topic), q))

        threads = [threading.Thread(target=soak.worker, args=(args.seed + i,)) for i in range(args.workers)]
        threads += [threading.Thread(target=soak.prober), threading.Thread(target=soak.monitor, args=(urls,))]
        threads += [threading.Thread(target=soak.flusher), threading.Thread(target=soak.health)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        chaos = [
            (0.2, "kill redis"),
            (0.35, "restart redis"),
            (0.5, "kill replica"),
            (0.65, "restart replica"),
        ]
        for frac, what in chaos:
            while time.monotonic() - t0 < frac * args.duration:
                time.sleep(0.2)
            now = time.monotonic()
            print(f"{now - t0:6.1f} s  {what}", flush=True)
            if what == "kill redis":
                procs["redis"].kill()
                procs["redis"].wait(10)
            elif what == "restart redis":
                procs["redis"], _ = start_redis(binary, str(tmp), **redis_opts)
            elif what == "kill replica":
                procs[urls[1]].send_signal(signal.SIGKILL)
                procs[urls[1]].wait(10)
            else:
                log = tmp / "replica-1.log"
                procs[urls[1]] = start_replica(ports[1], env, tmp / "keys.json", args.capacity, log)
                threading.Thread(target=back_up, args=(soak, urls[1], procs[urls[1]]), daemon=True).start()
            soak.events.append((now, what, urls[1] if "replica" in what else ""))
        while time.monotonic() - t0 < args.duration:
            time.sleep(0.2)
        soak.stop.set()
        for t in threads:
            t.join(600)
        elapsed = time.monotonic() - t0
        print("comparing answers with the cache-off reference ...", flush=True)
        report(soak, args, urls, parse_bytes(args.capacity), elapsed, t_start, t0)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        if reference is not None:
            reference.close()  # its worker thread joined before the interpreter exits
        shutil.rmtree(tmp, ignore_errors=True)


def report(
    soak: Soak,
    args: argparse.Namespace,
    urls: list[str],
    budget: int,
    elapsed: float,
    t_start: float,
    t0: float,
) -> None:
    kills = [(t, url) for t, what, url in soak.events if what == "kill replica"]

    def explained(o: Outcome) -> bool:  # in flight on the replica when it was killed
        return any(o.start <= t <= o.end and (o.replica in ("", url)) for t, url in kills)

    valid = [o for o in soak.outcomes if o.kind in ("valid", "probe", "probe-first")]
    served = [o for o in valid if o.status == 200 and not o.broken]
    failed = [o for o in valid if o.status >= 500 or o.status == 0 or o.broken]
    invalid = [o for o in soak.outcomes if o.kind == "invalid"]
    differ = [o for o in served if o.answer != soak.reference_answer(o.prompt)]
    probes = [o for o in soak.outcomes if o.kind == "probe" and o.status == 200]
    cross = [o for o in probes if o.cached > 0]
    other_4xx = [o for o in valid if 400 <= o.status < 500]
    hit = sum(o.cached for o in served)
    flushes = [o for o in soak.outcomes if o.kind == "flush"]
    flushed = sum(o.status == 200 for o in flushes)
    lat = sorted(soak.health_s)
    health_stats = [lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))], lat[-1]] if lat else []
    rows = [
        ("valid requests sent (chat, half streamed; probes included)", str(len(valid)), ""),
        ("served (200, whole answer)", str(len(served)), ""),
        ("5xx or broken streams, in flight on a killed replica", str(sum(explained(o) for o in failed)), ""),
        ("5xx or broken streams, otherwise", str(sum(not explained(o) for o in failed)), "must be 0"),
        ("valid requests answered 4xx (e.g. 429 under load)", str(len(other_4xx)), ""),
        ("invalid requests sent", str(len(invalid)), ""),
        ("invalid requests answered 4xx", str(sum(400 <= o.status < 500 for o in invalid)), ""),
        (
            "invalid requests answered otherwise",
            str(sum(not 400 <= o.status < 500 for o in invalid)),
            "must be 0",
        ),
        ("answers differing from the cache-off reference", str(len(differ)), "must be 0"),
        ("cross-tenant probes / hits", f"{len(probes)} / {len(cross)}", "hits must be 0"),
        ("cached tokens read by served requests", str(hit), ""),
        ("flushes (DELETE /v1/cache) sent / answered 200", f"{len(flushes)} / {flushed}", ""),
        (
            "router /health latency p50 / p99 / max",
            " / ".join(f"{v * 1000:.0f} ms" for v in health_stats) if health_stats else "none",
            "",
        ),
    ]
    for i, url in enumerate(urls):
        peak = soak.max_bytes.get(url, 0)
        rows.append(
            (f"replica {i}: peak cache bytes / budget", f"{peak} / {budget} ({peak / budget:.1%})", "<= 105%")
        )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start))
    odd = [o for o in invalid if not 400 <= o.status < 500]
    odd_text = "; ".join(
        f"{o.prompt[0]}: {o.status or 'no answer'}"
        + (" (in flight on the killed replica)" if explained(o) else "")
        for o in odd
    )
    lines = [
        "# Soak benchmark",
        "",
        f"`python benchmarks/soak.py {' '.join(sys.argv[1:])}` ({when}, "
        f"{os.cpu_count()} CPUs shared with other work, load average {os.getloadavg()[0]:.1f} at the end; "
        f"{elapsed:.0f} s of traffic).",
        "",
        f"Two `prefixcache serve` replicas of the embedded SmolLM2 ({args.capacity} memory budget each, "
        f"{args.tenants} tenants by API key, one salt secret) sharing a password-protected redis-server "
        "(256 MiB, allkeys-lru), the router (cache-aware) in front; "
        f"{args.workers} workers sending greedy chat completions of a 20-prompt pool (half streamed) and "
        f"{args.invalid_share:.0%} invalid requests (hostile structure included); a prober sending a fresh "
        "prompt as one tenant, then as another; a flush every 6 s. Every served answer is compared with a "
        "cache-off reference server's, whose engine computes as every replica's does (checked at "
        f"start: `{soak.runtime}`).",
        "",
        "Events: " + "; ".join(f"{t - t0:.0f} s {what}" for t, what, _ in sorted(soak.events)) + ".",
        "",
        "| measure | value | bound |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        f"Invalid requests not answered 4xx: {odd_text or 'none'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if differ:
        for o in differ:  # what tells a cause apart: the prompt, where it ran, what it read cached
            print(
                "differs:",
                o.prompt[0][:40],
                o.prompt[1],
                repr(o.answer),
                repr(soak.reference[o.prompt]),
                f"replica={o.replica} cached={o.cached} tenant={o.tenant[:20]}",
            )


if __name__ == "__main__":
    main()
