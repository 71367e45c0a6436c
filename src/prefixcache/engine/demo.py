"""``prefixcache demo``: the caching flows on a real model, one row each.

Every flow runs on a fresh Engine (its own cache and simulated clock) over one shared runner,
so flows do not warm each other. The own runner hits at any 16-token block; prompts are also
long enough for the HF runner's 512-token chunk to give hits.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache import FakeClock
from prefixcache.engine.engine import Engine
from prefixcache.engine.llama import LlamaRunner
from prefixcache.engine.model import ModelRunner
from prefixcache.engine.types import GenerationResult

Progress = Callable[[str], None]

FEW_SHOT = [
    (
        "Where is my order #1042?",
        "Order #1042 left our warehouse on Monday and should arrive within three days.",
    ),
    (
        "Can I return a opened blender?",
        "Yes: opened small appliances can be returned within 30 days with the receipt.",
    ),
    ("Do you ship to Norway?", "We ship to Norway; customs fees are paid by the recipient on delivery."),
    (
        "My discount code SPRING10 fails.",
        "SPRING10 expired on May 31; I can offer FREESHIP for free delivery instead.",
    ),
    ("How do I change my address?", "Open Account, then Addresses, edit the default address and save it."),
    ("Is the X200 vacuum cordless?", "The X200 is cordless, runs 45 minutes per charge and weighs 2.4 kg."),
]
QUESTIONS = [
    "Do you sell gift cards?",
    "How long is the warranty on kettles?",
    "Can I pay with PayPal?",
    "What are your opening hours?",
    "Is there a student discount?",
    "Can I cancel an order?",
]


def system_prompt(company: str, policy_version: int = 1, repeat: int = 6) -> str:
    """A stable, long support prompt: ~1,270 prompt tokens on SmolLM2 with repeat=6 (a 1,024-token
    hit at the 512-token chunk), ~680 with repeat=3 (a 512-token hit)."""
    shots = "\n".join(f"Customer: {q}\nAgent: {a}" for q, a in FEW_SHOT)
    rules = (
        f"You are the customer support assistant of {company}. Policy version {policy_version}. "
        "Answer in one or two sentences, be polite, never invent order data, and offer a human agent "
        "when the customer is upset. Prices include VAT. Returns are free within 30 days. "
    )
    return rules + "\n\nExamples:\n" + "\n\n".join([shots] * repeat)


@dataclass(slots=True)
class FlowRow:
    flow: str
    note: str
    results: list[GenerationResult] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.results)

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.usage.prompt_tokens for r in self.results)
        return sum(r.usage.cached_tokens for r in self.results) / prompt if prompt else 0.0

    @property
    def cached_tokens(self) -> int:
        return sum(r.usage.cached_tokens for r in self.results)

    @property
    def ttft_s(self) -> float:
        """Median TTFT of the flow's requests after its first (the steady state)."""
        rest = self.results[1:] or self.results
        return statistics.median(r.ttft_s for r in rest)

    def speedup(self, fallback_cold_s: float) -> float:
        """Cold TTFT (this flow's misses, else ``fallback_cold_s``) over :attr:`ttft_s`."""
        misses = [r.ttft_s for r in self.results if r.usage.cached_tokens == 0]
        cold = statistics.median(misses) if misses else fallback_cold_s
        return cold / self.ttft_s if self.ttft_s else 0.0


def _engine(runner: ModelRunner, **kw: Any) -> Engine:
    """An engine over ``runner`` as chosen (the own runner, or the HF one as it is)."""
    return Engine(runner, runner="llama" if isinstance(runner, LlamaRunner) else "hf", **kw)


def _ask(engine: Engine, system: str, question: str, max_tokens: int, **kw: Any) -> GenerationResult:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return engine.generate(messages=msgs, max_tokens=max_tokens, **kw)


def flow_warm(runner: ModelRunner, max_tokens: int = 4, questions: int = 4) -> FlowRow:
    row = FlowRow("a. warm", "stable system prompt + few-shot, then questions")
    with _engine(runner, clock=FakeClock()) as e:
        sys = system_prompt("Acme Home")
        row.results = [_ask(e, sys, q, max_tokens) for q in QUESTIONS[:questions]]
    return row


def flow_deploy(runner: ModelRunner, max_tokens: int = 4) -> FlowRow:
    row = FlowRow("b. cold after deploy", "policy v1 warm; v2 deployed: one miss, then warm")
    with _engine(runner, clock=FakeClock()) as e:
        _ask(e, system_prompt("Acme Home", 1), QUESTIONS[0], max_tokens)
        _ask(e, system_prompt("Acme Home", 1), QUESTIONS[1], max_tokens)
        v2 = system_prompt("Acme Home", 2)
        row.results = [_ask(e, v2, q, max_tokens) for q in QUESTIONS[2:5]]
    return row


def busting_prompts(n: int, where: str, repeat: int = 6) -> list[str]:
    """System prompts with a request id and timestamp at the top or the bottom."""
    base = system_prompt("Acme Home", repeat=repeat)
    out = []
    for i in range(n):
        meta = f"Request id: req-{7000 + i * 37:06d}. Time: 2025-03-0{1 + i}T10:{i:02d}:00Z."
        out.append(f"{meta}\n{base}" if where == "top" else f"{base}\n{meta}")
    return out


def flow_busting(
    runner: ModelRunner, max_tokens: int = 4, requests: int = 3, repeat: int = 6
) -> tuple[FlowRow, FlowRow]:
    rows = []
    for where in ("top", "bottom"):
        row = FlowRow(
            f"c. busting: id+time at {where}", "hit rate collapses" if where == "top" else "moved down: hits"
        )
        with _engine(runner, clock=FakeClock()) as e:
            row.results = [
                _ask(e, s, QUESTIONS[0], max_tokens) for s in busting_prompts(requests, where, repeat)
            ]
        rows.append(row)
    return rows[0], rows[1]


def flow_ttl(runner: ModelRunner, max_tokens: int = 4, requests: int = 4, pin: bool = False) -> list[FlowRow]:
    """Two endpoints under a 60 s TTL on a simulated clock: one every 10 s, one every 10 min.
    With ``pin`` the low-traffic prefix is pinned after its first request (keep-warm)."""
    clock = FakeClock()
    high = FlowRow("d. TTL 60 s, every 10 s", "high traffic stays warm")
    low = FlowRow(
        "e. keep-warm (pinned), every 10 min" if pin else "d. TTL 60 s, every 10 min",
        "pinned prefix survives the TTL" if pin else "gaps > TTL: every request misses",
    )
    sys_high, sys_low = system_prompt("Acme Home", repeat=3), system_prompt("Acme Garden", repeat=3)
    events = sorted(
        [(i * 10.0, "high", i) for i in range(requests)]
        + [(i * 600.0 + 5, "low", i) for i in range(requests)]
    )
    with _engine(runner, clock=clock, default_ttl_s=60.0) as e:
        for t, which, i in events:
            clock.set(t)
            if which == "high":
                if not pin:
                    high.results.append(_ask(e, sys_high, QUESTIONS[i % 6], max_tokens))
                continue
            low.results.append(_ask(e, sys_low, QUESTIONS[i % 6], max_tokens))
            if pin and i == 0:
                e.pin(
                    messages=[
                        {"role": "system", "content": sys_low},
                        {"role": "user", "content": QUESTIONS[0]},
                    ]
                )
    return [low] if pin else [high, low]


def run_demo(
    runner: ModelRunner, *, max_tokens: int = 4, progress: Progress | None = None
) -> tuple[list[FlowRow], float]:
    """All flows. Returns the rows and the cold TTFT (a miss on the long prompt) used for speedups."""
    say = progress or (lambda _m: None)
    rows: list[FlowRow] = []
    say("a. warm")
    rows.append(flow_warm(runner, max_tokens))
    cold = rows[0].results[0].ttft_s
    say("b. cold after a deploy")
    rows.append(flow_deploy(runner, max_tokens))
    say("c. cache busting")
    rows.extend(flow_busting(runner, max_tokens))
    say("d. TTL versus traffic")
    rows.extend(flow_ttl(runner, max_tokens))
    say("e. keep-warm")
    rows.extend(flow_ttl(runner, max_tokens, pin=True))
    return rows, cold
