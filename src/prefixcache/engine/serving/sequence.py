"""A request's running state: its prompt (prefilled once) and the choices decoded from it.

    choice = Choice(0, request, tokenizer, eos_ids, context_len)
    delta = choice.take(logits)        # sample, logprob, detokenize; None when nothing to stream
    choice.finish_reason               # "" while running, then "stop" or "length"

:class:`Choice` is shared by both runners. :class:`SequenceGroup` is the batch scheduler's view
of one admitted request: the prompt's block table while it is prefilled, then ``n`` choices that
each hold a block table made of the prompt's full blocks (shared :class:`PoolBlock` handles,
never written again, one hold per table) and blocks of their own (a copy of the prompt's last,
partial block, then the blocks their generated tokens fill).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache import Match
from prefixcache.cache.keys import BlockHash
from prefixcache.engine.pool import KVPool, PoolBlock
from prefixcache.engine.serving.detok import TextAssembler
from prefixcache.engine.serving.sampling import Sampler, token_logprobs
from prefixcache.engine.serving.worker import Job
from prefixcache.engine.types import ChoiceDelta, Completion, GenerationResult, Request, TokenLogprob, Usage


class Choice:
    """One choice's decoding: its own sampler (seed + index), tokens, text and logprobs."""

    __slots__ = (
        "index",
        "request",
        "sampler",
        "text",
        "tokens",
        "logprobs",
        "finish_reason",
        "eos",
        "context_len",
        "blocks",
        "finished_at",
        "guide",
    )

    def __init__(
        self, index: int, request: Request, tokenizer: Any, eos: frozenset[int], context_len: int
    ) -> None:
        self.index = index
        self.request = request
        self.sampler = Sampler(request.params.for_choice(index))
        self.text = TextAssembler(tokenizer, request.stop)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.finish_reason = ""
        self.eos = eos
        self.context_len = context_len
        self.blocks: list[PoolBlock] = []  # batch runner: this choice's block table, position // B
        self.finished_at = 0.0
        #: Structured output (``engine/serving/guided.py``): the grammar's state, or None.
        self.guide = request.grammar.matcher() if request.grammar is not None else None

    @property
    def position(self) -> int:
        """Absolute position of the last sampled token (the next decode row)."""
        return len(self.request.ids) + len(self.tokens) - 1

    def take(self, logits: Any) -> ChoiceDelta | None:
        """Sample the next token from ``logits`` (float32 [vocab]); returns what to stream:
        new text, the token's logprob when asked, and on the last token the finish reason."""
        req = self.request
        guide = self.guide
        token = self.sampler(logits if guide is None else guide.mask(logits))  # logits stay as computed
        self.tokens.append(token)
        if guide is not None:
            guide.accept(token)
        lp: list[TokenLogprob] = []
        if self.logprobs is not None:
            value, top = token_logprobs(logits, token, req.logprobs or 0)
            lp.append(TokenLogprob(token, value, top, text_offset=len(self.text.text)))
            self.logprobs.extend(lp)
        text = ""
        if token in self.eos:
            self.finish_reason = "stop"
        else:
            text = self.text.push(token)
            if self.text.stop_sequence is not None or (guide is not None and guide.done):
                self.finish_reason = "stop"
            elif len(self.tokens) >= req.max_tokens or len(req.ids) + len(self.tokens) >= self.context_len:
                self.finish_reason = "length"
        if self.finish_reason:
            text += self.text.finish()
            self.finished_at = time.perf_counter()
        if text or lp or self.finish_reason:
            return ChoiceDelta(self.index, text, lp, self.finish_reason or None)
        return None

    def result(
        self,
        usage: Usage | None,
        *,
        started: float,
        first_token_at: float,
        queue_s: float,
        outcome: str,
        first_logits: Any = None,
        commit_s: float = 0.0,
    ) -> GenerationResult:
        """This choice's :class:`GenerationResult` (``usage``: the prompt's cache usage)."""
        req = self.request
        cached, written = (usage.cached_tokens, usage.cache_write_tokens) if usage is not None else (0, 0)
        return GenerationResult(
            text=self.text.text,
            tokens=list(self.tokens),
            finish_reason=self.finish_reason,
            usage=Usage(
                len(req.ids), cached, written, len(self.tokens), usage.cache_reason if usage else None
            ),
            ttft_s=first_token_at - started,
            prefill_s=first_token_at - started,
            decode_s=(self.finished_at or time.perf_counter()) - first_token_at,
            queue_s=queue_s,
            commit_s=commit_s,
            outcome=outcome,
            prompt_token_ids=req.ids,
            stop_sequence=self.text.stop_sequence,
            first_logits=first_logits,
            index=self.index,
            logprobs=self.logprobs,
        )


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One admitted request in the batch scheduler: prefill state, then its ``n`` choices."""

    job: Job
    request: Request
    reserved: int  # pool blocks reserved for it (prompt once, each choice's own blocks)
    match: Match | None = None
    blocks: list[PoolBlock] = field(default_factory=list)  # the prompt's block table until the fork
    computed: int = 0  # prompt tokens whose KV is in its blocks
    committed: int = 0  # prompt tokens committed to the cache
    choices: list[Choice] = field(default_factory=list)  # empty until the prompt is computed
    started: float = 0.0
    first_token_at: float = 0.0
    first_logits: Any = None

    @property
    def prompt_len(self) -> int:
        return len(self.request.ids)

    @property
    def width(self) -> int:
        """Decode rows it takes in a step once its prompt is done (one per choice)."""
        return self.request.n

    @property
    def keys(self) -> list[BlockHash]:
        """The prompt's block keys (empty with the cache off)."""
        return self.request.keys or []

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def decoding(self) -> list[Choice]:
        return [c for c in self.choices if not c.finish_reason]

    @property
    def done(self) -> bool:
        return bool(self.choices) and not self.decoding

    @staticmethod
    def blocks_needed(request: Request, block_size: int, context_len: int) -> int:
        """Pool blocks a request can use at most: the prompt's full blocks once, and for each
        choice the rest of its positions (prompt tail, generated tokens)."""
        total = -(-min(len(request.ids) + request.max_tokens, context_len) // block_size)
        shared = len(request.ids) // block_size
        return shared + request.n * (total - shared)

    def fork(self, pool: KVPool, tokenizer: Any, eos: frozenset[int], context_len: int) -> None:
        """Start the choices once the prompt is computed. Each reads the prompt's full blocks in
        place; the last, partial block (if any) goes to choice 0 and is copied for the others,
        since their first generated tokens land in its free slots. Caller reserved the copies."""
        full = self.prompt_len // pool.block_size
        shared, tail = self.blocks[:full], self.blocks[full:]
        for i in range(self.request.n):  # each choice holds its table's blocks (pool.hold)
            choice = Choice(i, self.request, tokenizer, eos, context_len)
            own = [pool.hold(b) for b in tail] if i == 0 else [self._copy(pool, b) for b in tail]
            choice.blocks = [*(pool.hold(b) for b in shared), *own]
            self.choices.append(choice)
        blocks, self.blocks = self.blocks, []
        pool.free_all(blocks)  # the prompt's table lets go: the choices hold them now

    @staticmethod
    def _copy(pool: KVPool, block: PoolBlock) -> PoolBlock:
        new = pool.copy(block)
        if new is None:  # the reservation makes this unreachable; say so loudly if it is not
            raise RuntimeError("the KV pool is exhausted despite reservations (a bug)")
        return new

    def completion(self) -> Completion:
        m = self.match
        usage, outcome = (m.usage, str(m.outcome.value)) if m is not None else (None, "miss")
        return Completion(
            [
                c.result(
                    usage,
                    started=self.started,
                    first_token_at=self.first_token_at,
                    queue_s=self.started - self.job.submitted,
                    outcome=outcome,
                    first_logits=self.first_logits,
                )
                for c in self.choices
            ]
        )

    def drop_blocks(self, pool: KVPool) -> None:
        """Drop every hold this request has (blocks nobody else holds return to the pool)."""
        blocks, self.blocks = self.blocks, []
        pool.free_all(blocks)
        for c in self.choices:
            blocks, c.blocks = c.blocks, []
            pool.free_all(blocks)


__all__ = ["Choice", "SequenceGroup"]
