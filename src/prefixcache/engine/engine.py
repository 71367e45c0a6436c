"""Engine: requests over a runner and a PrefixCache, behind one worker thread.

    engine = Engine()                                   # embedded SmolLM2, cache on
    r = engine.generate(messages=[...], max_tokens=32)  # or prompt="...", or prompt_token_ids=[...]
    for item in engine.stream(prompt="Hi"):             # str deltas, then the GenerationResult
        ...
    c = engine.generate_choices(prompt="Hi", n=3, logprobs=5, temperature=0.8, seed=1)
    c.choices[2].text, c.choices[2].logprobs, c.usage  # a Completion: prompt counted once

Two runners, chosen by the model (``runner="auto"``):

* **The own Llama runner** (:class:`~prefixcache.engine.llama.LlamaRunner`; Llama, SmolLM2, Mistral,
  Qwen2): continuous batching over a paged KV pool (``engine/serving/scheduler.py``). Its forward is
  row- and batch-invariant, so a hit may end on any block boundary, every full block of a prompt is
  stored, and hits are bitwise exact also when batched with other requests.
* **The Hugging Face runner** (any other causal LM, or ``runner="hf"``): one request at a time
  (``engine/serving/sequential.py``). Its bits depend on the rows a pass computes, so a hit is
  rounded down to a prefill-chunk boundary and only blocks inside complete chunks are committed.

``n`` choices (decoded from one prefill) and logprobs: :meth:`stream_choices`, :meth:`generate_choices`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, TypeVar

from prefixcache.cache import CacheStats, FakeClock, PrefixCache
from prefixcache.cache.tiers.codec import BlockLayout
from prefixcache.engine.config import DEFAULT_PREFILL_CHUNK, EngineConfig, WorkerConfig, WorkerStats
from prefixcache.engine.llama import LlamaRunner
from prefixcache.engine.model import ModelRunner, env_dtype
from prefixcache.engine.pool import KVPool, pool_size
from prefixcache.engine.prompts import PromptReader
from prefixcache.engine.runtime import off_this_thread, quantized_runner, select_runner
from prefixcache.engine.serving.admission import check_request_fields, make_request, prefetch_blocks
from prefixcache.engine.serving.guided import Grammar, Grammars
from prefixcache.engine.serving.prompt_logprobs import PromptLogprob, prompt_logprobs
from prefixcache.engine.serving.sampling import InvalidRequestError, SamplingParams
from prefixcache.engine.serving.scheduler import BatchWorker
from prefixcache.engine.serving.sequential import SequentialWorker, chunk_schedule
from prefixcache.engine.serving.verify import Auditor, VerifyResult
from prefixcache.engine.serving.worker import Job
from prefixcache.engine.types import (
    MAX_TOP_LOGPROBS,
    ChoiceDelta,
    Completion,
    EngineClosedError,
    GenerationResult,
    PromptDone,
    QueueFullError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


CancelSignal = threading.Event | Callable[[], bool] | None
#: The request fields of :meth:`Engine.verify`'s run (beside its prompt, tenant and salt).
_ONE_GREEDY_TOKEN: dict[str, Any] = dict(
    max_tokens=1, stop=None, ttl_s=None, ttl_plan=None, return_logits=False, n=1, logprobs=None
)


class Engine(PromptReader):
    """Generation with exact prefix caching. Thread-safe: calls from any thread are queued to
    one worker. See the module docstring for the two runners and the request lifecycle; the
    prompt methods (``tokenize``, ``render``, ``prompt_ids``...) are :class:`PromptReader`'s."""

    def __init__(
        self,
        model: str | os.PathLike[str] | ModelRunner | None = None,
        *,
        config: EngineConfig | None = None,
        cache: PrefixCache | None = None,
        clock: Callable[[], float] | None = None,
        **options: Any,
    ) -> None:
        """``model``: a .gguf path, an HF folder, a loaded :class:`ModelRunner` (shared weights),
        or None (embedded SmolLM2). ``config``: an :class:`EngineConfig` (what each setting does
        is said there); ``options`` (its field names: ``max_batch=8``) replace its fields.
        ``cache``: an existing PrefixCache to share (its block size wins); otherwise one is made
        from the config's capacity and TTL and ``clock``."""
        cfg = self.config = EngineConfig.of(config, options)
        env_dtype()  # a bad $PREFIXCACHE_DTYPE fails before the model loads
        if isinstance(model, ModelRunner):
            base = model
        else:
            load_dtype = cfg.dtype if (cfg.runner == "hf" and cfg.dtype) else "float32"
            base = ModelRunner.load(model, dtype=load_dtype, threads=cfg.threads)
        self.runner = off_this_thread(lambda: self._runner(base, cfg))
        block_size = cache.block_size if cache is not None else cfg.block_size
        chunk = cfg.chunk
        if chunk < block_size or chunk % block_size:
            raise ValueError(
                f"prefill_chunk ({chunk}) must be a positive multiple of block_size ({block_size})"
            )
        self.block_size = block_size
        self.prefill_chunk = chunk
        self.batched = isinstance(self.runner, LlamaRunner)
        #: Where a hit may end, as the runner reports it: any block for the own runner, a
        #: prefill-chunk boundary for the HF one.
        self.alignment = self.runner.hit_alignment(block_size, chunk)
        self.clock = clock or (cache.clock if cache is not None else time.monotonic)
        self.cache = (cache or cfg.make_cache(block_size, self.clock)) if cfg.enable_cache else None
        self.fingerprint = self.runner.fingerprint(block_size, chunk)
        if self.cache is not None:  # a block promoted from a tier must fit the KV layout
            self.cache.set_block_layout(self.block_layout)
            # Tier reads happen in _prepare on the request's thread (prefetch), never under the
            # cache's lock on the step thread: a slow Redis stalls only the request that reads it.
            self.cache.promote_in_match = False
        self.pool = None
        self._worker: BatchWorker | SequentialWorker
        self._max_n = cfg.max_batch
        worker_config = WorkerConfig(
            block_size=block_size,
            prefill_chunk=chunk,
            alignment=self.alignment,
            fingerprint=self.fingerprint,
            max_queue=cfg.max_queue,
            max_batch=cfg.max_batch,
            max_wait_s=cfg.max_wait_s,
        )
        if isinstance(self.runner, LlamaRunner):
            self.pool, reserve = off_this_thread(lambda: self._new_pool(cfg.kv_reserve_tokens))
            if self.cache is not None:
                self.pool.watch(self.cache.store)  # the cache's holds on pool blocks
                if self.cache.adopt is None:
                    self.cache.adopt = self.pool.adopt  # blocks promoted from a tier land in the pool
            worker_config = dataclasses.replace(worker_config, reserve_blocks=reserve)
            self._worker = BatchWorker(self.runner, self.pool, self.cache, worker_config)
        else:
            self._worker = SequentialWorker(self.runner, self.cache, worker_config)
        #: The live exactness audit (own runner, cache on), or None.
        self.auditor: Auditor | None = None
        if isinstance(self._worker, BatchWorker) and self.cache is not None:
            self.auditor = self._worker.auditor = Auditor(cfg.verify_rate)

    @staticmethod
    def _runner(base: ModelRunner, cfg: EngineConfig) -> ModelRunner:
        runner = select_runner(base, cfg.runner, cfg.dtype)
        if cfg.weights != "float":
            runner = quantized_runner(base, runner, cfg.weights)
        return runner

    def _new_pool(self, reserve_tokens: int | None) -> tuple[KVPool, int]:
        """The KV pool: the cache's byte budget (pinned included) plus the running reserve."""
        runner = self.runner
        assert isinstance(runner, LlamaRunner)
        store = self.cache.store if self.cache is not None else None
        cached_bytes = store.capacity_bytes + store.pinned_capacity_bytes if store is not None else None
        num, reserve = pool_size(
            runner.block_nbytes(self.block_size),
            cached_bytes,
            reserve_tokens,
            self.context_len,
            self.block_size,
        )
        return runner.new_pool(num, self.block_size), reserve

    @classmethod
    def tiny(cls, seed: int = 0, **kwargs: Any) -> Engine:
        """An engine over a random tiny Llama (tests, demos of the mechanics): chunk 16 by default."""
        kwargs.setdefault("prefill_chunk", 16)
        return cls(ModelRunner.tiny(seed), **kwargs)

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def context_len(self) -> int:
        return self.runner.context_len

    @property
    def block_layout(self) -> BlockLayout:
        """One cached block's payload: ``[layers, 2, kv_heads, B, head_dim]`` in the KV dtype."""
        r = self.runner
        shape = (r.num_layers, 2, r.num_kv_heads, self.block_size, r.head_dim)
        return BlockLayout(shape=shape, dtype=str(r.dtype).removeprefix("torch."))

    @property
    def queue_depth(self) -> int:
        """Requests admitted and not finished (waiting or running)."""
        return self._worker.depth

    @property
    def max_queue(self) -> int:
        return self._worker.max_queue

    def stats(self, tenant: str | None = None) -> CacheStats:
        return self.cache.stats(tenant) if self.cache is not None else CacheStats()

    def worker_stats(self) -> WorkerStats:
        """The request worker's counters (prefilled tokens, steps, what is running)."""
        return self._worker.stats()

    def run_on_worker(self, fn: Callable[[], T], timeout: float = 3600.0) -> T:
        """``fn()`` on the worker thread between two steps (on this thread before the worker has
        started): compute beside the engine's that should share its OpenMP pool (see runtime)."""
        return self._worker.between_steps(fn, timeout)

    def check_integrity(self) -> None:
        """Check the cache's invariants and, with the own runner, that every KV pool block is
        free, held by the cache or held by running requests, as counted (between two steps).
        Raises AssertionError (:class:`~prefixcache.engine.pool.PoolIntegrityError`) saying what
        is wrong."""
        if self.cache is not None:
            self.cache.check_integrity()
        self._worker.between_steps(self._worker.check_integrity)

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker after the requests already queued; wait for its thread. Idempotent."""
        self._worker.close(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespace(self, tenant: str = "default", salt: bytes | str = b"") -> Any:
        if self.cache is None:
            raise InvalidRequestError("the cache is disabled on this engine (enable_cache=False)")
        return self.cache.namespace(self.fingerprint, tenant=tenant, salt=salt)

    def pin(
        self, messages: Any = None, prompt: Any = None, *, tenant: str = "default", salt: bytes = b""
    ) -> int:
        """Keep-warm: pin the cached blocks of this prompt's prefix. Returns pinned tokens."""
        ids = self.prompt_ids(messages, prompt)
        return self.cache.pin(ids, self.namespace(tenant, salt)) if self.cache is not None else 0

    def unpin(
        self, messages: Any = None, prompt: Any = None, *, tenant: str = "default", salt: bytes = b""
    ) -> int:
        ids = self.prompt_ids(messages, prompt)
        return self.cache.unpin(ids, self.namespace(tenant, salt)) if self.cache is not None else 0

    def verify(
        self,
        messages: Any = None,
        prompt: Any = None,
        prompt_token_ids: Any = None,
        *,
        tenant: str = "default",
        salt: bytes | str = b"",
        timeout_s: float = 120.0,
    ) -> VerifyResult:
        """Check one prompt now: run it (one token, greedy) and, when it reads cached blocks,
        recompute it with the cache bypassed and compare logits and KV bit for bit (the live
        audit's check, see ``engine/serving/verify.py``). Raises InvalidRequestError without an audit
        (the Hugging Face runner, or the cache off). Past ``timeout_s`` (no spare capacity came):
        result ``skipped``."""
        if self.auditor is None:
            raise InvalidRequestError(
                "the exactness audit needs the own Llama runner with the cache on; this engine has "
                + ("no cache" if self.cache is None else "the Hugging Face runner")
            )
        from concurrent.futures import Future

        job = self._prepare(
            messages,
            prompt,
            prompt_token_ids,
            SamplingParams(),
            tenant=tenant,
            salt=salt,
            cancel=None,
            **_ONE_GREEDY_TOKEN,
        )
        future: Future[VerifyResult] = Future()
        job.request.verify = future
        for _ in self._worker.submit(job):
            pass
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:  # no spare capacity came in time (a busy engine): not checked
            return VerifyResult("skipped", len(job.request.ids), 0)

    def prompt_logprobs(
        self,
        messages: Any = None,
        prompt: Any = None,
        prompt_token_ids: Any = None,
        *,
        top: int = 0,
    ) -> list[PromptLogprob | None]:
        """Each prompt token's logprob given the tokens before it (None for the first) and its
        ``top`` (0..20) likeliest alternatives, recomputed with the cache bypassed: bitwise what
        a cold run gives (``engine/serving/prompt_logprobs.py``). Own runner only."""
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"prompt logprobs take an integer from 0 to {MAX_TOP_LOGPROBS}; got {top!r}"
            )
        ids = self.prompt_ids(messages, prompt, prompt_token_ids)
        return prompt_logprobs(self.runner, ids, top, tokenizer=self.tokenizer, block_size=self.block_size)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler (``engine/serving/guided.py``): ``grammar=engine.grammars.compile(
        "json_schema", schema)`` on a request; compiled grammars are cached per spec."""
        return Grammars(self.tokenizer, self.runner.vocab_size, self.runner.eos_token_ids)

    @property
    def max_n(self) -> int:
        """The most choices one request may ask for: ``max_batch`` (they decode side by side)."""
        return self._max_n

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens computed (not read from the cache) since the engine started. A request
        with ``n`` choices counts its prompt once: its choices decode from one prefill."""
        return self._worker.prefilled_tokens

    def generate(
        self, messages: Any = None, prompt: Any = None, prompt_token_ids: Any = None, **kw: Any
    ) -> GenerationResult:
        """Run one request to completion. Same arguments as :meth:`stream`."""
        result: GenerationResult | None = None
        for item in self.stream(messages, prompt, prompt_token_ids, **kw):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None  # the worker always ends a job with a result or an error
        return result

    def generate_choices(
        self, messages: Any = None, prompt: Any = None, prompt_token_ids: Any = None, **kw: Any
    ) -> Completion:
        """Run one request with ``n`` choices to completion. Same arguments as :meth:`stream_choices`."""
        result: Completion | None = None
        for item in self.stream_choices(messages, prompt, prompt_token_ids, **kw):
            if isinstance(item, Completion):
                result = item
        assert result is not None
        return result

    def stream(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | Sequence[int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        **kw: Any,
    ) -> Iterator[str | GenerationResult]:
        """Yield text deltas as they are decoded, then one :class:`GenerationResult` (with
        ``logprobs=k`` it carries each token's logprob). Arguments: those of
        :meth:`stream_choices` except ``n`` (one choice)."""
        if kw.get("n", 1) != 1:
            raise InvalidRequestError(
                "stream() and generate() give one choice: use stream_choices() for n > 1"
            )
        inner = self.stream_choices(messages, prompt, prompt_token_ids, **kw)
        try:
            for item in inner:
                if isinstance(item, ChoiceDelta):
                    if item.text:
                        yield item.text
                elif isinstance(item, Completion):
                    yield item.choices[0]
        finally:
            inner.close()  # a consumer that stops early cancels the request here

    def stream_choices(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | Sequence[int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        n: int = 1,
        logprobs: int | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        tenant: str = "default",
        salt: bytes | str = b"",
        ttl_s: float | None = None,
        ttl_plan: Sequence[tuple[int, float]] | None = None,
        cancel: CancelSignal = None,
        return_logits: bool = False,
        grammar: Grammar | None = None,
    ) -> Generator[PromptDone | ChoiceDelta | Completion, None, None]:
        """Yield one :class:`PromptDone` once the prompt is prefilled (its cache usage is final
        then), :class:`ChoiceDelta` items as the choices decode, then one :class:`Completion`.

        ``n`` (1 to :attr:`max_n`) choices decode from one prefill of the prompt; with ``seed``,
        choice i samples from ``seed + i``. ``logprobs``: None, or k in 0..20: every generated
        token's logprob and its k most likely alternatives (:class:`TokenLogprob`).
        Validation errors (ValueError subclasses) are raised at the first ``next()``, before
        the request is queued; :class:`QueueFullError` when ``max_queue`` requests are in
        flight. Closing the generator early (or setting ``cancel``) stops the request and
        releases its cache references before ``close()`` returns.
        """
        params = SamplingParams(temperature, top_p, top_k, seed)
        job = self._prepare(
            messages,
            prompt,
            prompt_token_ids,
            params,
            max_tokens=max_tokens,
            stop=stop,
            tenant=tenant,
            salt=salt,
            ttl_s=ttl_s,
            ttl_plan=ttl_plan,
            cancel=cancel,
            return_logits=return_logits,
            n=n,
            logprobs=logprobs,
        )
        job.request.grammar = grammar  # structured output: every choice decodes inside it
        yield from self._worker.submit(job)

    def _prepare(
        self,
        messages: Any,
        prompt: Any,
        ids_in: Any,
        params: SamplingParams,
        *,
        cancel: CancelSignal,
        **fields: Any,
    ) -> Job:
        if self._worker.closed:
            raise EngineClosedError("this engine is closed; create a new Engine")
        check_request_fields(params, max_n=self.max_n, **fields)  # before tokenizing
        ids = self.prompt_ids(messages, prompt, ids_in)
        request = make_request(ids, params, context_len=self.context_len, **fields)
        self._worker.validate(request)
        if self.cache is not None:  # tier reads here, on the request's thread, not under the lock
            ns = self.namespace(request.tenant, request.salt)
            prefetch_blocks(self.cache, ns, request, self.alignment, self.auditor)
        return Job(request, cancel=cancel)


def fake_clock_engine(runner: ModelRunner, **kwargs: Any) -> Engine:
    """An engine over ``runner`` whose cache reads a :class:`FakeClock` (``engine.clock``)."""
    kwargs.setdefault("clock", FakeClock(0.0))
    return Engine(runner, **kwargs)


__all__ = ["DEFAULT_PREFILL_CHUNK", "Engine", "QueueFullError", "chunk_schedule", "fake_clock_engine"]
