"""Continuous batching: one engine step at a time over every running request.

    worker = BatchWorker(runner, pool, cache, WorkerConfig(block_size=16, prefill_chunk=512, ...))

Each step decodes one token for every choice of every request past its prefill (one row each)
and spends the rest of ``token_budget`` on prefill chunks of the others, all in one
:meth:`LlamaRunner.step`. Requests join between steps (admission) and leave when all their
choices finish, or when they are cancelled or fail. ``max_batch`` bounds the decode rows: a
request with ``n`` choices takes ``n`` of them.

Admission (``engine/serving/admission.py``): overdue requests first, then the longest cached prefix,
then arrival order. A request whose next uncached block is being prefilled right now by a running
request waits for that request's commit instead of computing the same blocks again (in-flight
dedup): prompts sharing a prefix that arrive together prefill it once. Prefill commits its full
blocks after every step (the pool block the step wrote becomes the cache's payload: no copy), so
a waiting request reads them as soon as they land. An overdue request that does not fit yet
stops the admission pass, so later, smaller requests cannot keep it out.

KV blocks: a request reserves, at admission, the pool blocks its prompt and ``max_tokens`` can
need (``reserve_blocks`` in all); blocks come from the pool as its rows are computed; a hit's
blocks are the cache's own, read in place (the request holds them: ``engine/pool.py``). The
pool holds the cache's budget plus the reserve, so a reserved request never finds it empty.
``n`` > 1 shares one prefill: the prompt is computed once, then its choices read its full blocks
in place and each decodes into its own blocks from a copy of the prompt's last, partial block
(``engine/serving/sequence.py``).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from prefixcache.cache import Match, PrefixCache
from prefixcache.cache.keys import BlockHash
from prefixcache.engine.config import WorkerConfig, WorkerStats
from prefixcache.engine.llama import LlamaRunner, Segment
from prefixcache.engine.pool import KVPool, PoolBlock
from prefixcache.engine.serving.admission import Admission
from prefixcache.engine.serving.sequence import Choice, SequenceGroup
from prefixcache.engine.serving.verify import Auditor
from prefixcache.engine.serving.worker import Call, Job, Worker
from prefixcache.engine.types import PromptDone, Request, Usage

log = logging.getLogger(__name__)


class BatchWorker(Worker):
    """The step loop over a :class:`LlamaRunner`, its pool and the cache (see the module doc)."""

    def __init__(
        self, runner: LlamaRunner, pool: KVPool, cache: PrefixCache | None, config: WorkerConfig
    ) -> None:
        super().__init__(None, max_queue=config.max_queue)
        if config.max_batch < 1 or config.prefill_chunk < 1:
            raise ValueError(
                f"max_batch and token_budget must be >= 1; got {config.max_batch}, {config.prefill_chunk}"
            )
        if not isinstance(runner, LlamaRunner):
            raise TypeError("the batch worker steps a paged KV pool: it needs the own runner")
        self.runner: LlamaRunner = runner
        self.pool = pool
        self.cache = cache
        self.config = config
        self.block_size = pool.block_size
        self.reserve_blocks = config.reserve_blocks
        self.max_batch = config.max_batch
        self.token_budget = config.prefill_chunk
        self.admission = Admission(
            block_size=pool.block_size,
            context_len=runner.context_len,
            max_batch=config.max_batch,
            reserve_blocks=config.reserve_blocks,
            max_wait_s=config.max_wait_s,
        )
        self.waiting: list[Job] = []
        self.running: list[SequenceGroup] = []
        self.reserved = 0
        self.rows = 0  # decode rows the running requests take (their n, summed)
        #: Counters for tests, metrics and benchmarks: prompt tokens prefilled (computed, not read;
        #: once per request whatever its n), steps run, decode rows computed, seconds in steps.
        self.prefilled_tokens = 0
        self.steps = 0
        self.decoded_rows = 0
        self.step_s = 0.0
        self._closing = False
        #: The live exactness audit (``engine/serving/verify.py``), or None: it samples hits at their
        #: prompt's end and recomputes them in the steps' spare budget.
        self.auditor: Auditor | None = None

    def namespace(self, tenant: str, salt: bytes) -> Any:
        assert self.cache is not None
        return self.cache.namespace(self.config.fingerprint, tenant=tenant, salt=salt)

    def stats(self) -> WorkerStats:
        return WorkerStats(
            prefilled_tokens=self.prefilled_tokens,
            steps=self.steps,
            decoded_rows=self.decoded_rows,
            step_s=self.step_s,
            waiting=len(self.waiting),
            running=len(self.running),
            reserved_blocks=self.reserved,
            rows=self.rows,
        )

    def holdings(self) -> list[PoolBlock]:
        """Every pool hold the running requests and the audit take, one entry per hold."""
        out: list[PoolBlock] = []
        for group in self.running:
            out.extend(group.blocks)
            for choice in group.choices:
                out.extend(choice.blocks)
        if self.auditor is not None:
            out.extend(self.auditor.holdings())
        return out

    def check_integrity(self) -> None:
        """The pool's counts against the cache's payloads and the running requests' tables
        (call between steps: :meth:`Worker.between_steps`)."""
        cached: list[Any] = []
        if self.cache is not None:
            for run in self.cache.store.runs():
                cached.extend(run.payloads)
        self.pool.check_integrity(cached=cached, held=self.holdings())

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            audit = self.auditor is not None and self.auditor.busy
            self._intake(block=not self.running and not self.waiting and not audit)
            self._run_calls()
            if self._closing and not self.running and not self.waiting:
                return
            self._drop_cancelled()
            self._admit()
            if self.running or audit:
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
            elif isinstance(job, Call):
                self._calls.append(job)
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
        for group in [g for g in self.running if g.job.cancelled()]:
            group.job.finish_cancelled()
            self._end(group)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        if self.auditor is not None:
            self.auditor.before_admit(self)
        if not self.waiting or self.rows >= self.max_batch:
            return
        cache, policy = self.cache, self.admission
        now = time.perf_counter()
        inflight = policy.inflight_keys(self.running) if cache is not None else {}
        for job in policy.order(self.waiting, now, cache, self.namespace):
            if not policy.fits(job.request, self.rows, self.reserved):
                if policy.overdue(job, now):
                    break  # an overdue request waits for room: nothing admitted past it
                continue
            try:
                group = self._prepare(job, inflight)
            except BaseException as exc:  # a bad request fails alone
                self.waiting.remove(job)
                self._failed(job, exc)
                self._retire(job)
                continue
            if group is None:
                continue  # waits for an in-flight prefix (or was cancelled): try the next one
            self.waiting.remove(job)
            self.running.append(group)
            if group.match is not None:  # the next ones in this pass see what it will compute
                for key in group.keys[group.computed // self.block_size :]:
                    inflight.setdefault(key, group)

    def validate(self, request: Request) -> None:
        self.admission.validate(request)

    def need(self, req: Request) -> int:
        return self.admission.need(req)

    def _prepare(self, job: Job, inflight: dict[BlockHash, SequenceGroup]) -> SequenceGroup | None:
        """Match, reserve and build the block table of ``job`` (which fits); None when it must wait."""
        req: Request = job.request
        B = self.block_size
        n = len(req.ids)
        cache = self.cache
        match: Match | None = None
        if cache is not None:
            keys, packed = self.admission.keys(job, cache, self.namespace)
            if self.auditor is not None and self.auditor.holds_back(keys):
                return None  # a block it would read was found wrong and is not removed yet
            if inflight:
                cached = cache.cached_prefix(keys, packed)
                if cached < len(keys) and keys[cached] in inflight and cached * B < n - 1:
                    return None  # another request is computing our next block right now
            ns = self.namespace(req.tenant, req.salt)
            match = cache.match(
                None,
                ns,
                align_tokens=self.config.alignment,
                ttl_s=req.ttl_s,
                ttl_plan=req.ttl_plan,
                keys=keys,
                packed=packed,
            )
            self.pool.settle_adopted()  # blocks promoted for it that found no room go back
        if not job.start():  # cancelled meanwhile
            if match is not None and cache is not None:
                cache.release(match)
            job.finish_cancelled()
            self.waiting.remove(job)
            self._retire(job)
            return None
        group = SequenceGroup(
            job=job, request=req, reserved=self.need(req), match=match, started=time.perf_counter()
        )
        self.reserved += group.reserved
        self.rows += group.width
        if match is not None and match.cached_blocks:
            for block in match.blocks:  # the request holds each hit block while it reads it
                payload = block.payload
                if isinstance(payload, PoolBlock) and payload.pool is self.pool:
                    group.blocks.append(self.pool.hold(payload))
                else:
                    group.blocks.append(self._copy_in(payload))
            group.computed = group.committed = match.cached_tokens
        return group

    def _copy_in(self, payload: Any) -> PoolBlock:
        """A hit block held elsewhere (a tier's tensor, another engine's pool): a private copy."""
        block = self.pool.copy_in(payload)
        if block is None:
            raise RuntimeError(
                "a cached block could not be copied into the KV pool (full, or another layout)"
            )
        return block

    def alloc(self) -> PoolBlock:
        block = self.pool.alloc()
        if block is None:  # the reserve makes this unreachable; say so loudly if it is not
            raise RuntimeError("the KV pool is exhausted despite reservations (a bug)")
        return block

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        budget = self.token_budget
        plan: list[tuple[SequenceGroup, Choice | None, Segment]] = []
        for group in self.running:
            for choice in group.decoding:
                pos = choice.position
                self._grow(choice.blocks, pos + 1)
                table = [b.index for b in choice.blocks]
                plan.append(
                    (group, choice, Segment([choice.tokens[-1]], pos, table, decode=True, want_logits=True))
                )
                budget -= 1
        for group in self.running:
            if group.prefilling and budget > 0:
                stop = min(group.prompt_len, group.computed + budget)
                self._grow(group.blocks, stop)
                plan.append(
                    (
                        group,
                        None,
                        Segment(
                            group.request.ids[group.computed : stop],
                            group.computed,
                            [b.index for b in group.blocks],
                            want_logits=stop == group.prompt_len,
                        ),
                    )
                )
                budget -= stop - group.computed
        audit = self.auditor.segments(self, budget) if self.auditor is not None else []
        if not plan and not audit:  # only the audit has work, and it must wait: poll
            time.sleep(0.01)
            return
        started = time.perf_counter()
        try:
            logits = self.runner.step(self.pool, [seg for _, _, seg in plan] + audit)
        except BaseException as exc:  # every request of the step fails; the loop goes on
            if self.auditor is not None:
                self.auditor.step_failed(self)
            for group, _, _ in plan:
                self._failed(group.job, exc)
                self._end(group)
            return
        self.steps += 1
        self.step_s += time.perf_counter() - started
        row = 0
        for group, decoded, seg in plan:
            out = logits[row] if seg.want_logits else None
            row += seg.want_logits
            if group not in self.running:  # it failed earlier in this loop
                continue
            try:
                if decoded is not None:
                    self.decoded_rows += 1
                    self._take(group, decoded, out)
                else:
                    self.prefilled_tokens += len(seg.tokens)
                    group.computed = seg.end
                    self._commit(group)
                    if out is not None:
                        self._prompt_done(group, out)
                if group.done:
                    self._finish(group)
            except BaseException as exc:  # this request fails alone; the loop goes on
                self._failed(group.job, exc)
                self._end(group)
        if audit:
            self.auditor.take(self, audit, logits[row:])  # type: ignore[union-attr]

    def _grow(self, blocks: list[PoolBlock], upto: int) -> None:
        """Extend a block table to cover positions ``[0, upto)``."""
        while len(blocks) * self.block_size < upto:
            blocks.append(self.alloc())

    def _commit(self, group: SequenceGroup) -> None:
        """Store the full prompt blocks computed so far (the pool blocks themselves)."""
        cache, m = self.cache, group.match
        if cache is None or m is None:
            return
        upto = group.computed // self.block_size * self.block_size
        if upto <= group.committed:
            return
        nbytes = self.pool.block_nbytes
        blocks = group.blocks
        cache.commit(m, lambda i: (blocks[i], nbytes), upto_tokens=upto)
        group.committed = upto

    def _prompt_done(self, group: SequenceGroup, logits: Any) -> None:
        """The prompt's last row: report its usage, start its choices, sample their first tokens."""
        runner = self.runner
        group.first_token_at = time.perf_counter()
        if group.request.return_logits:
            group.first_logits = logits.clone()
        if self.auditor is not None:  # before fork: the hit's blocks are the group's here
            self.auditor.sample(self, group, logits)
        group.fork(self.pool, runner.tokenizer, runner.eos_token_ids, runner.context_len)
        m = group.match
        cached, written = (m.usage.cached_tokens, m.usage.cache_write_tokens) if m is not None else (0, 0)
        group.job.post(
            PromptDone(
                Usage(group.prompt_len, cached, written, 0, m.reason if m is not None else None),
                str(m.outcome.value) if m is not None else "miss",
                group.request.ids,
            )
        )
        for choice in group.choices:
            self._take(group, choice, logits)

    def _take(self, group: SequenceGroup, choice: Choice, logits: Any) -> None:
        delta = choice.take(logits)
        if delta is not None:
            group.job.post(delta)
        if choice.finish_reason:  # its holds go: its own blocks are free, shared ones at the last reader
            blocks, choice.blocks = choice.blocks, []
            self.pool.free_all(blocks)

    def _finish(self, group: SequenceGroup) -> None:
        group.job.finish(group.completion())
        self._end(group)

    def _end(self, group: SequenceGroup) -> None:
        """Release everything ``group`` holds and hand out its last items (once)."""
        if group not in self.running:
            return
        self.running.remove(group)
        cache = self.cache
        if group.match is not None and cache is not None:
            cache.release(group.match)
        group.drop_blocks(self.pool)  # its holds go: blocks the cache does not hold are free
        self.reserved -= group.reserved
        self.rows -= group.width
        group.reserved = 0
        self._retire(group.job)


__all__ = ["BatchWorker"]
