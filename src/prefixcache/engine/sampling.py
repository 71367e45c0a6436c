"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class InvalidRequestError(ValueError):
    """A request the engine cannot run as given; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` 0 means greedy (argmax; ties to the lowest id). ``top_k`` 0 and
    ``top_p`` 1.0 disable those filters. ``seed`` makes sampling reproducible."""

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
        return self.temperature == 0.0


class Sampler:
    """Draws one token from last-position logits. One per request (it owns the RNG)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.gen: torch.Generator | None = None
        if not params.greedy:
            self.gen = torch.Generator()
            if params.seed is not None:
                self.gen.manual_seed(params.seed)
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
