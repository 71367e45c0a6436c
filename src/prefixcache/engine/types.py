"""The engine's typed results and errors (imported by the server through ``prefixcache.engine``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prefixcache.cache.stats import Usage
from prefixcache.engine.model import ModelNotFoundError
from prefixcache.engine.prompts import EmptyPromptError, PromptTooLongError
from prefixcache.engine.serving.sampling import InvalidRequestError, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from prefixcache.engine.serving.guided import Grammar

__all__ = [
    "ChoiceDelta",
    "Completion",
    "EmptyPromptError",
    "EngineClosedError",
    "GenerationResult",
    "GenerationSpec",
    "InvalidRequestError",
    "ModelNotFoundError",
    "PromptDone",
    "PromptTooLongError",
    "QueueFullError",
    "Request",
    "TokenLogprob",
    "Usage",
]

#: The most alternatives per token a request may ask for (``logprobs``; OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20


class QueueFullError(RuntimeError):
    """The engine's request queue is at ``max_queue``: retry later (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine was closed; create a new one."""


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """One generation as a caller asks the engine for it: the arguments of
    ``Engine.stream_choices`` / ``generate_choices`` but ``cancel`` (a signal, not a request
    field). The defaults are the engine's.

    The prompt is exactly one of ``messages`` (chat messages the engine renders), ``prompt``
    (prompt text, special-token strings included) and ``prompt_token_ids``. ``stop``: stop
    strings; ``tenant`` and ``salt``: the cache namespace; ``ttl_s``: the TTL of the blocks this
    request writes; ``ttl_plan``: ``(token_end, ttl_s)`` breakpoints; ``grammar``: a compiled
    structured-output grammar. The engine validates every field (ValueError subclasses).
    """

    messages: Sequence[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    max_tokens: int = 256
    n: int = 1
    logprobs: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    tenant: str = "default"
    salt: bytes = b""
    ttl_s: float | None = None
    ttl_plan: list[tuple[int, float]] | None = None
    grammar: Grammar | None = field(default=None, repr=False)

    def with_prompt_ids(self, ids: Sequence[int]) -> GenerationSpec:
        """The same request with its prompt given as the token ids it renders to (tokenized
        once by the caller, not again by the engine)."""
        return replace(self, messages=None, prompt=None, prompt_token_ids=ids)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``Engine.stream_choices`` for this request (add ``cancel``)."""
        return {
            "messages": self.messages,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "n": self.n,
            "logprobs": self.logprobs,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "tenant": self.tenant,
            "salt": self.salt,
            "ttl_s": self.ttl_s,
            "ttl_plan": self.ttl_plan,
            "grammar": self.grammar,
        }


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
    #: Choices decoded from the one prefill of ``ids`` (``n`` > 1 shares the prompt's KV).
    n: int = 1
    #: None: no logprobs; k >= 0: each generated token's logprob and its k best alternatives.
    logprobs: int | None = None
    #: Structured output: a compiled :class:`~prefixcache.engine.serving.guided.Grammar`, or None.
    grammar: Any = field(default=None, repr=False)
    #: A future for the exactness audit's result of this request's hit (``Engine.verify``).
    verify: Any = field(default=None, repr=False)
    #: Block keys and packed tokens of ``ids``, filled once (prefetch or the batch scheduler).
    keys: list[Any] | None = field(default=None, repr=False)
    packed: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the model, and its best alternatives.

    ``logprob`` is the log-softmax, in float32, of the very logits row the sampler received,
    before temperature, top-k and top-p (the model's own distribution, as OpenAI and vLLM's
    default report it). ``top``: the ``logprobs`` most likely tokens as ``(token id, logprob)``,
    best first, ties to the lower id. ``text_offset``: where this token's text starts in the
    choice's text (characters). A hit, a miss, batching and the cache off give the same bits.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    text_offset: int = 0


@dataclass(frozen=True, slots=True)
class PromptDone:
    """Streamed once, after the prompt's prefill and before any text: the cache outcome is
    final here (``usage.completion_tokens`` is 0). Anthropic's ``message_start`` is built from it.
    ``prompt_token_ids``: the prompt's tokens (the server checks who wrote what its miss reason
    shows before the answer goes out)."""

    usage: Usage
    outcome: str
    prompt_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class ChoiceDelta:
    """Streamed output of choice ``index``: new ``text`` (maybe ""), the ``logprobs`` of the
    tokens sampled since its previous delta (empty unless requested), and on its last delta
    ``finish_reason`` ("stop" or "length")."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class GenerationResult:
    """One finished generation.

    ``finish_reason``: "stop" (EOS or a stop string; the stop string is not in ``text``) or
    "length" (max_tokens or the context reached). A cancelled request has no result: ``generate``
    raises ``RequestCancelledError`` and a closed stream just ends.
    Timings in seconds, measured on the worker: ``ttft_s`` from the start of the request's
    processing (after its wait in the queue, ``queue_s``) to the first sampled token.
    ``first_logits`` (only with ``return_logits=True``): float32 [vocab] logits the first token
    was sampled from (exactness tests compare them with ``torch.equal``). ``usage`` counts this
    choice's tokens; :class:`Completion` sums the choices of one request.
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
    #: Which choice of its request this is (0 unless ``n`` > 1).
    index: int = 0
    #: One entry per generated token (``len == usage.completion_tokens``), or None when not asked.
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)

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


@dataclass(slots=True)
class Completion:
    """The ``n`` choices of one request, decoded from one prefill of its prompt, in index order."""

    choices: list[GenerationResult]

    @property
    def usage(self) -> Usage:
        """The prompt counted once, the choices' generated tokens summed (OpenAI's convention)."""
        first = self.choices[0].usage
        return Usage(
            first.prompt_tokens,
            first.cached_tokens,
            first.cache_write_tokens,
            sum(c.usage.completion_tokens for c in self.choices),
            first.cache_reason,
        )
