"""Sampling parameters, the sampler (greedy, temperature, top-k, top-p, seeded) and logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

#: Seeds are taken modulo 2**64 (torch's generator seeds; -1 and 2**64 - 1 are the same seed).
SEED_MODULUS = 1 << 64

#: Temperatures below this are greedy (vLLM's rule): dividing logits by 1e-40 overflows float32
#: to inf, and the softmax of that is NaN. Far below it the distribution is one-hot anyway.
GREEDY_BELOW = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine cannot run as given; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` 0 means greedy (argmax; ties to the lowest id), and so does any
    temperature below :data:`GREEDY_BELOW`. ``top_k`` 0 and ``top_p`` 1.0 disable those
    filters. ``seed`` makes sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def validate(self) -> SamplingParams:
        """Returns self, or raises :class:`InvalidRequestError` naming the bad field."""
        t = self.temperature
        if not isinstance(t, int | float) or math.isnan(t) or t < 0 or math.isinf(t):
            raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy); got {t!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off); got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer or None; got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an ``n`` > 1 request: with a seed, choice i
        draws from seed + i (so choice 0 is what the same request with n=1 gives, and every
        choice is reproducible); without one, each choice seeds its own generator at random."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % SEED_MODULUS)


class Sampler:
    """Draws one token from last-position logits. One per request (it owns the RNG)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.gen: torch.Generator | None = None
        if not params.greedy:
            self.gen = torch.Generator()
            if params.seed is not None:
                self.gen.manual_seed(params.seed % SEED_MODULUS)
            else:
                self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits``: [vocab] float32. Returns the chosen token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits).item())
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.gen).item())


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability under ``logits`` ([vocab] float32, the row the sampler saw)
    and the ``top`` most likely tokens as (id, logprob), best first, ties to the lower id.

    Always one 1-D ``log_softmax`` over the row: the call and its shape are the same for every
    row however the step that computed it was batched, so equal logits give equal logprobs, bit
    for bit (and a hit's logits equal a miss's: docs/engine.md)."""
    lp = torch.log_softmax(logits.detach().float().reshape(-1), dim=-1).cpu()
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        best = tuple(sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: (-p[1], p[0])))
    return float(lp[token]), best
