"""The rows one request brings to a runner step (``LlamaRunner.step``, ``native_step``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Segment"]


@dataclass(slots=True)
class Segment:
    """One request's rows in a step: ``tokens`` at positions ``start, start + 1, ...``.

    ``table`` holds the pool block indices of positions ``[0, start + len(tokens))`` (at least);
    the step writes the new rows' KV into those blocks. ``decode``: one generated token.
    ``want_logits``: the step returns the logits of this segment's last row (with
    ``all_logits``: of every row, in order; prompt logprobs).
    """

    tokens: Sequence[int]
    start: int
    table: Sequence[int]
    decode: bool = False
    want_logits: bool = False
    all_logits: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)
