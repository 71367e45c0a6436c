"""The engine's typed results and errors (imported by the server through ``prefixcache.engine``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.stats import Usage
from prefixcache.engine.model import ModelNotFoundError
from prefixcache.engine.prompts import EmptyPromptError
from prefixcache.engine.sampling import InvalidRequestError, SamplingParams

__all__ = [
    "EmptyPromptError",
    "EngineClosedError",
    "GenerationResult",
    "InvalidRequestError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "QueueFullError",
    "Request",
    "Usage",
]


class PromptTooLongError(InvalidRequestError):
    """prompt tokens + max_tokens exceed the model's context."""


class QueueFullError(RuntimeError):
    """The engine's request queue is at ``max_queue``: retry later (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine was closed; create a new one."""


@dataclass(slots=True)
class Request:
    """A validated request as the worker runs it (built by ``Engine.stream``)."""

    ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    tenant: str = "default"
    salt: bytes = b""
    ttl_s: float | None = None
    ttl_plan: list[tuple[int, float]] | None = None
    return_logits: bool = False
    #: Filled by the batch scheduler once: block keys and packed tokens of ``ids``.
    keys: list[Any] | None = field(default=None, repr=False)
    packed: bytes = field(default=b"", repr=False)


@dataclass(slots=True)
class GenerationResult:
    """One finished generation.

    ``finish_reason``: "stop" (EOS or a stop string; the stop string is not in ``text``) or
    "length" (max_tokens or the context reached). A cancelled request has no result: ``generate``
    raises ``RequestCancelledError`` and a closed stream just ends.
    Timings in seconds, measured on the worker: ``ttft_s`` from the start of the request's
    processing (after its wait in the queue, ``queue_s``) to the first sampled token.
    ``first_logits`` (only with ``return_logits=True``): float32 [vocab] logits the first token
    was sampled from (exactness tests compare them with ``torch.equal``).
    """

    text: str
    tokens: list[int]
    finish_reason: str
    usage: Usage
    ttft_s: float
    prefill_s: float
    decode_s: float
    queue_s: float = 0.0
    commit_s: float = 0.0
    outcome: str = "miss"  # "hit" | "partial" | "miss" (cache off: "miss")
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    stop_sequence: str | None = None
    first_logits: Any = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (no token ids, no logits)."""
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": self.usage.as_dict(),
            "ttft_s": self.ttft_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "queue_s": self.queue_s,
            "outcome": self.outcome,
            "stop_sequence": self.stop_sequence,
        }
