"""Continuous batching: one engine step at a time over every running request.

    worker = BatchWorker(engine, pool, max_batch=16, token_budget=512)

Each step decodes one token for every request past its prefill (one row each) and spends the
rest of ``token_budget`` on prefill chunks of the others, all in one :meth:`LlamaRunner.step`.
Requests join between steps (admission) and leave when they finish, are cancelled or fail.

Admission, in this order of preference: a request that has waited longer than ``max_wait_s``
(oldest first, so nothing starves); then the longest cached prefix (SGLang's longest-prefix
policy: it is cheapest now and its blocks may be evicted later); then arrival order. A request
whose next uncached block is being prefilled right now by a running request waits for that
request's commit instead of computing the same blocks again (in-flight dedup): prompts sharing
a prefix that arrive together prefill it once. Prefill commits its full blocks after every step
(the pool block the step wrote becomes the cache's payload: no copy), so a waiting request reads
them as soon as they land.

KV blocks: a request reserves, at admission, the pool blocks its prompt and ``max_tokens`` can
need (``reserve_blocks`` in all); blocks come from the pool as its rows are computed; a hit's
blocks are the cache's own, read in place. The pool holds the cache's budget plus the reserve,
so a reserved request never finds the pool empty.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixcache.cache import Match
from prefixcache.cache.keys import BlockHash, pack_tokens
from prefixcache.engine.detok import TextAssembler
from prefixcache.engine.llama import Segment
from prefixcache.engine.pool import KVPool, PoolBlock
from prefixcache.engine.sampling import Sampler
from prefixcache.engine.types import GenerationResult, Request, Usage
from prefixcache.engine.worker import Job, Worker

if TYPE_CHECKING:  # pragma: no cover
    from prefixcache.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Sequence:
    """One admitted request's running state."""

    job: Job
    request: Request
    reserved: int  # pool blocks reserved for it
    match: Match | None = None
    blocks: list[PoolBlock] = field(default_factory=list)  # its block table, position // B
    computed: int = 0  # prompt tokens whose KV is in its blocks
    committed: int = 0  # prompt tokens committed to the cache
    tokens: list[int] = field(default_factory=list)  # generated
    sampler: Sampler | None = None
    text: TextAssembler | None = None
    started: float = 0.0
    first_token_at: float = 0.0
    first_logits: Any = None
    finish_reason: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.request.ids)

    @property
    def keys(self) -> list[BlockHash]:
        """The prompt's block keys (empty with the cache off)."""
        return self.request.keys or []

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


class BatchWorker(Worker):
    """The step loop of an :class:`Engine` over a :class:`LlamaRunner` (see the module doc)."""

    def __init__(self, engine: Engine, pool: KVPool, *, reserve_blocks: int, max_batch: int = 16,
                 token_budget: int = 512, max_queue: int = 64, max_wait_s: float = 5.0) -> None:
        super().__init__(None, max_queue=max_queue)
        if max_batch < 1 or token_budget < 1:
            raise ValueError(f"max_batch and token_budget must be >= 1; got {max_batch}, {token_budget}")
        self.engine = engine
        self.pool = pool
        self.block_size = pool.block_size
        self.reserve_blocks = reserve_blocks
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.max_wait_s = max_wait_s
        self.waiting: list[Job] = []
        self.running: list[Sequence] = []
        self.reserved = 0
        #: Counters for tests, metrics and benchmarks: prompt tokens prefilled (computed, not read),
        #: steps run, decode rows computed, seconds spent in steps.
        self.prefilled_tokens = 0
        self.steps = 0
        self.decoded_rows = 0
        self.step_s = 0.0
        self._closing = False

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            self._intake(block=not self.running and not self.waiting)
            if self._closing and not self.running and not self.waiting:
                return
            self._drop_cancelled()
            self._admit()
            if self.running:
                self._step()
            elif self.waiting:  # nothing can run yet (cannot happen with a sane reserve): poll
                time.sleep(0.01)

    def _intake(self, block: bool) -> None:
        try:
            job = self._jobs.get(timeout=None) if block and not self._closing else self._jobs.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is None:
                self._closing = True
            else:
                self.waiting.append(job)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.waiting if j.cancelled()]:
            self.waiting.remove(job)
            job.finish_cancelled()
            self._retire(job)
        for seq in [s for s in self.running if s.job.cancelled()]:
            seq.job.finish_cancelled()
            self._end(seq)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.max_batch:
            return
        cache = self.engine.cache
        now = time.perf_counter()
        inflight = self._inflight_keys() if cache is not None else {}
        order = sorted(self.waiting, key=lambda j: self._priority(j, now))
        for job in order:
            if len(self.running) >= self.max_batch:
                break
            try:
                seq = self._prepare(job, inflight)
            except BaseException as exc:  # a bad request fails alone
                self.waiting.remove(job)
                self._failed(job, exc)
                self._retire(job)
                continue
            if seq is None:
                continue  # waits (in-flight prefix or no room): try the next one
            self.waiting.remove(job)
            self.running.append(seq)
            if seq.match is not None:  # the next ones in this pass see what it will compute
                for key in seq.keys[seq.computed // self.block_size :]:
                    inflight.setdefault(key, seq)

    def _priority(self, job: Job, now: float) -> tuple[int, int, float]:
        if now - job.submitted > self.max_wait_s:
            return (0, 0, job.submitted)
        cached = 0
        cache = self.engine.cache
        if cache is not None and len(self.waiting) > 1:
            keys, packed = self._keys(job)
            cached = cache.cached_prefix(keys, packed)
        return (1, -cached, job.submitted)

    def _keys(self, job: Job) -> tuple[list[BlockHash], bytes]:
        """The request's block keys and packed tokens, computed once per job."""
        req: Request = job.request
        if req.keys is None:
            req.packed = pack_tokens(req.ids)
            req.keys = self.engine.cache.block_keys(req.ids, self.engine.namespace(req.tenant, req.salt))  # type: ignore[union-attr]
        return req.keys, req.packed

    def _inflight_keys(self) -> dict[BlockHash, Sequence]:
        """Keys of the blocks that running requests are prefilling and have not committed yet."""
        out: dict[BlockHash, Sequence] = {}
        for seq in self.running:
            if seq.prefilling and seq.match is not None:
                for key in seq.keys[seq.committed // self.block_size :]:
                    out.setdefault(key, seq)
        return out

    def _prepare(self, job: Job, inflight: dict[BlockHash, Sequence]) -> Sequence | None:
        """Match, reserve and build the block table of ``job``; None when it must wait."""
        req: Request = job.request
        B = self.block_size
        n = len(req.ids)
        need = -(-min(n + req.max_tokens, self.engine.context_len) // B)
        if self.reserved + need > self.reserve_blocks:
            return None
        cache = self.engine.cache
        match: Match | None = None
        keys: list[BlockHash] = []
        packed = b""
        if cache is not None:
            keys, packed = self._keys(job)
            if inflight:
                cached = cache.cached_prefix(keys, packed)
                if cached < len(keys) and keys[cached] in inflight and cached * B < n - 1:
                    return None  # another request is computing our next block right now
            ns = self.engine.namespace(req.tenant, req.salt)
            match = cache.match(None, ns, align_tokens=self.engine.alignment, ttl_s=req.ttl_s,
                                ttl_plan=req.ttl_plan, keys=keys, packed=packed)
        if not job.start():  # cancelled meanwhile
            if match is not None and cache is not None:
                cache.release(match)
            job.finish_cancelled()
            self.waiting.remove(job)
            self._retire(job)
            return None
        seq = Sequence(job=job, request=req, reserved=need, match=match,
                       sampler=Sampler(req.params), text=TextAssembler(self.engine.tokenizer, req.stop),
                       started=time.perf_counter())
        self.reserved += need
        if match is not None and match.cached_blocks:
            for block in match.blocks:
                payload = block.payload
                if not (isinstance(payload, PoolBlock) and payload.pool is self.pool):
                    payload = self._copy_in(payload)
                seq.blocks.append(payload)
            seq.computed = seq.committed = match.cached_tokens
        return seq

    def _copy_in(self, payload: Any) -> PoolBlock:
        """A hit block held elsewhere (a tier's tensor, another engine's pool): a private copy."""
        block = self.pool.adopt(payload)
        if not (isinstance(block, PoolBlock) and block.pool is self.pool):
            raise RuntimeError("a cached block could not be copied into the KV pool (full, or another layout)")
        return block

    def _alloc(self) -> PoolBlock:
        block = self.pool.alloc()
        if block is None:  # the reserve makes this unreachable; say so loudly if it is not
            raise RuntimeError("the KV pool is exhausted despite reservations (a bug)")
        return block

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        budget = self.token_budget
        plan: list[tuple[Sequence, Segment]] = []
        for seq in self.running:
            if not seq.prefilling:
                pos = seq.prompt_len + len(seq.tokens) - 1
                self._grow(seq, pos + 1)
                plan.append((seq, Segment([seq.tokens[-1]], pos, [b.index for b in seq.blocks], decode=True,
                                          want_logits=True)))
                budget -= 1
        for seq in self.running:
            if seq.prefilling and budget > 0:
                stop = min(seq.prompt_len, seq.computed + budget)
                self._grow(seq, stop)
                plan.append((seq, Segment(seq.request.ids[seq.computed : stop], seq.computed,
                                          [b.index for b in seq.blocks], want_logits=stop == seq.prompt_len)))
                budget -= stop - seq.computed
        started = time.perf_counter()
        try:
            logits = self.engine.runner.step(self.pool, [seg for _, seg in plan])
        except BaseException as exc:  # every request of the step fails; the loop goes on
            for seq, _ in plan:
                self._failed(seq.job, exc)
                self._end(seq)
            return
        self.steps += 1
        self.step_s += time.perf_counter() - started
        row = 0
        for seq, seg in plan:
            out = logits[row] if seg.want_logits else None
            row += seg.want_logits
            try:
                if seg.decode:
                    self.decoded_rows += 1
                else:
                    self.prefilled_tokens += len(seg.tokens)
                    seq.computed = seg.end
                    self._commit(seq)
                if out is not None:
                    self._sampled(seq, out)
            except BaseException as exc:  # this request fails alone; the loop goes on
                self._failed(seq.job, exc)
                self._end(seq)

    def _grow(self, seq: Sequence, upto: int) -> None:
        """Give ``seq`` blocks for positions ``[0, upto)``."""
        B = self.block_size
        while len(seq.blocks) * B < upto:
            seq.blocks.append(self._alloc())

    def _commit(self, seq: Sequence) -> None:
        """Store the full prompt blocks computed so far (the pool blocks themselves)."""
        cache, m = self.engine.cache, seq.match
        if cache is None or m is None:
            return
        upto = seq.computed // self.block_size * self.block_size
        if upto <= seq.committed:
            return
        nbytes = self.pool.block_nbytes
        cache.commit(m, lambda i: (seq.blocks[i], nbytes), upto_tokens=upto)
        seq.committed = upto

    def _sampled(self, seq: Sequence, logits: Any) -> None:
        """A token from ``logits`` for ``seq``: stream it, and finish ``seq`` when it ends."""
        assert seq.sampler is not None and seq.text is not None
        req = seq.request
        if not seq.tokens:
            seq.first_token_at = time.perf_counter()
            if req.return_logits:
                seq.first_logits = logits.clone()
        token = seq.sampler(logits)
        seq.tokens.append(token)
        if token in self.engine.runner.eos_token_ids:
            seq.finish_reason = "stop"
        else:
            delta = seq.text.push(token)
            if delta:
                seq.job.post(delta)
            if seq.text.stop_sequence is not None:
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= req.max_tokens or seq.prompt_len + len(seq.tokens) >= self.engine.context_len:
                seq.finish_reason = "length"
        if seq.finish_reason:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        assert seq.text is not None
        rest = seq.text.finish()
        if rest:
            seq.job.post(rest)
        now = time.perf_counter()
        req, m = seq.request, seq.match
        usage = m.usage if m is not None else None
        seq.job.finish(GenerationResult(
            text=seq.text.text, tokens=list(seq.tokens), finish_reason=seq.finish_reason,
            usage=Usage(seq.prompt_len, usage.cached_tokens if usage else 0,
                        usage.cache_write_tokens if usage else 0, len(seq.tokens)),
            ttft_s=seq.first_token_at - seq.started, prefill_s=seq.first_token_at - seq.started,
            decode_s=now - seq.first_token_at, queue_s=seq.started - seq.job.submitted,
            outcome=str(m.outcome.value) if m is not None else "miss", prompt_token_ids=req.ids,
            stop_sequence=seq.text.stop_sequence, first_logits=seq.first_logits,
        ))
        self._end(seq)

    def _end(self, seq: Sequence) -> None:
        """Release everything ``seq`` holds and hand out its last items (once)."""
        if seq not in self.running:
            return
        self.running.remove(seq)
        cache = self.engine.cache
        if seq.match is not None and cache is not None:
            cache.release(seq.match)
        seq.blocks.clear()  # the blocks not committed go back to the pool
        self.reserved -= seq.reserved
        seq.reserved = 0
        self._retire(seq.job)


__all__ = ["BatchWorker", "Sequence"]
