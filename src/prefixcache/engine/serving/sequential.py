"""The Hugging Face runner's worker: one request at a time, in absolute prefill chunks.

    worker = SequentialWorker(runner, cache, WorkerConfig(block_size=16, prefill_chunk=512, ...))

Lifecycle of a request: match (acquire) -> KV of the hit blocks into a DynamicCache -> prefill
the rest in chunks on absolute multiples of ``prefill_chunk`` -> sample the first token ->
commit the prompt blocks of complete chunks -> decode -> release (in a finally). The runner's
bits depend on the rows a pass computes, so a hit is rounded down to a chunk boundary (the
runner's alignment) and only blocks inside complete chunks are committed (docs/engine.md).

``n`` > 1: the prompt is prefilled once; the choices then decode one after another, each from
its own copy of the prompt's KV (a deep copy works for a DynamicCache of any layer kind), so
choice i gives bitwise what a lone request with its seed gives.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from prefixcache.cache import Match, PrefixCache
from prefixcache.engine.config import WorkerConfig, WorkerStats
from prefixcache.engine.model import ModelRunner
from prefixcache.engine.serving import kv
from prefixcache.engine.serving.sequence import Choice
from prefixcache.engine.serving.worker import Job, Worker
from prefixcache.engine.types import Completion, PromptDone, Request, Usage


def chunk_schedule(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """Forward passes covering ``[start, stop)``: cut at every absolute multiple of ``chunk``."""
    if start % chunk:
        raise ValueError(f"prefill must start on a chunk boundary; {start} % {chunk} != 0")
    return [(a, min(a + chunk, stop)) for a in range(start, stop, chunk)]


class SequentialWorker(Worker):
    """Runs each job over a Hugging Face :class:`ModelRunner` and the cache to its end."""

    def __init__(self, runner: ModelRunner, cache: PrefixCache | None, config: WorkerConfig) -> None:
        super().__init__(self._run, max_queue=config.max_queue)
        self.runner = runner
        self.cache = cache
        self.config = config
        self._scratch = kv.Scratch()  # hit KV is assembled here (worker thread only)
        #: Prompt tokens prefilled (computed, not read): once per request whatever its n.
        self.prefilled_tokens = 0

    def stats(self) -> WorkerStats:
        return WorkerStats(prefilled_tokens=self.prefilled_tokens)

    def _run(self, job: Job) -> None:
        """Process one job on the worker thread; posts its items and its result to ``job``."""
        config = self.config
        runner, cache = self.runner, self.cache
        r: Request = job.request
        ids: list[int] = r.ids
        n = len(ids)
        t0 = time.perf_counter()
        m: Match | None = None
        try:
            hit = 0
            if cache is not None:
                ns = cache.namespace(config.fingerprint, tenant=r.tenant, salt=r.salt)
                m = cache.match(ids, ns, align_tokens=config.alignment, ttl_s=r.ttl_s, ttl_plan=r.ttl_plan)
                hit = m.cached_tokens
            past = (
                kv.build_cache(runner, [b.payload for b in m.blocks], self._scratch)
                if m and m.blocks
                else runner.new_cache()
            )
            logits = None
            for a, b in chunk_schedule(hit, n, config.prefill_chunk):
                if job.cancelled():
                    return job.finish_cancelled()
                logits = runner.forward(ids[a:b], past)
                self.prefilled_tokens += b - a
            eos = runner.eos_token_ids
            choices = [Choice(i, r, runner.tokenizer, eos, runner.context_len) for i in range(r.n)]
            first = choices[0].take(logits)
            first_token_at = time.perf_counter()
            commit_s = self._commit(m, past, n) if m is not None else 0.0
            usage = m.usage if m is not None else None
            outcome = str(m.outcome.value) if m is not None else "miss"
            cached, written = (usage.cached_tokens, usage.cache_write_tokens) if usage else (0, 0)
            reason = usage.cache_reason if usage else None
            job.post(PromptDone(Usage(n, cached, written, 0, reason), outcome, ids))
            prompt_kv = copy.deepcopy(past) if r.n > 1 else None  # each later choice decodes from it
            for choice in choices:
                if choice.index:
                    past = prompt_kv if choice.index == r.n - 1 else copy.deepcopy(prompt_kv)
                delta = first if choice.index == 0 else choice.take(logits)
                if delta is not None:
                    job.post(delta)
                if not self._decode(job, past, choice):
                    return job.finish_cancelled()
            first_logits = logits.clone() if r.return_logits and logits is not None else None
            job.finish(
                Completion(
                    [
                        c.result(
                            usage,
                            started=t0,
                            first_token_at=first_token_at,
                            queue_s=t0 - job.submitted,
                            outcome=outcome,
                            first_logits=first_logits,
                            commit_s=commit_s,
                        )
                        for c in choices
                    ]
                )
            )
        finally:
            if m is not None and cache is not None:
                cache.release(m)

    def _commit(self, m: Match, past: Any, n: int) -> float:
        """Store the prompt blocks of complete chunks that are not cached yet. Returns seconds."""
        cache = self.cache
        assert cache is not None
        t = time.perf_counter()
        hit = m.cached_tokens
        chunk = self.config.prefill_chunk
        limit = (n // chunk) * chunk
        if limit <= hit:
            return 0.0
        B = self.config.block_size
        payloads: list[Any] = []

        def payload_fn(i: int) -> tuple[Any, int]:
            if not payloads:  # one copy of the whole range, only if some block is new
                payloads.extend(kv.slice_blocks(past, hit, limit, B))
            p = payloads[i - hit // B]
            return p, kv.payload_nbytes(p)

        # upto_tokens: partial-chunk blocks stay out (see the module docstring).
        cache.commit(m, payload_fn, upto_tokens=limit)
        return time.perf_counter() - t

    def _decode(self, job: Job, past: Any, choice: Choice) -> bool:
        """Decode ``choice`` from its first sampled token to its end, posting its deltas.
        Returns False when cancelled."""
        forward = self.runner.forward
        while not choice.finish_reason:
            if job.cancelled():
                return False
            delta = choice.take(forward([choice.tokens[-1]], past))
            if delta is not None:
                job.post(delta)
        return True


__all__ = ["SequentialWorker", "chunk_schedule"]
