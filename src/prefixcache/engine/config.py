"""The engine's settings, one home for each default.

    config = EngineConfig(max_batch=8, prefill_chunk=256)
    engine = Engine(model, config=config)        # or Engine(model, max_batch=8, prefill_chunk=256)

:class:`EngineConfig` is what an :class:`~prefixcache.engine.engine.Engine` is built from;
:class:`WorkerConfig` is the small part a request worker needs (``engine/serving/``), derived
from it once the runner and the cache are known. :class:`WorkerStats` is what a worker reports
(:meth:`Engine.worker_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from prefixcache.cache import PrefixCache
from prefixcache.cache.config import DEFAULTS

#: Prefill tokens per step (own runner) or per forward pass (HF runner). For the HF runner it is
#: also the hit granularity: chosen from measurements on SmolLM2/2 cores (docs/engine.md), >= 90%
#: of single-pass prefill throughput.
DEFAULT_PREFILL_CHUNK = 512
#: Requests admitted and not finished (waiting or running) before QueueFullError.
DEFAULT_MAX_QUEUE = 64
#: Decode rows per step (own runner); also the largest ``n``.
DEFAULT_MAX_BATCH = 16
#: Seconds a waiting request may be passed over before it is admitted first (own runner).
DEFAULT_MAX_WAIT_S = 5.0
#: Share of hits the live exactness audit checks under ``serve`` (the library's ``verify_rate``
#: default is 0: off).
DEFAULT_VERIFY_RATE = 0.01
RUNNERS = ("auto", "llama", "hf")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from but the model, a shared cache and a clock.

    ``runner``: ``auto`` (the own Llama runner where it can compute the model), ``llama`` or
    ``hf``. ``dtype``: None picks ``$PREFIXCACHE_DTYPE`` when set, else bfloat16 on CPUs with bf16
    instructions and on CUDA, float32 elsewhere (the HF runner: float32 unless ``dtype`` says
    otherwise). ``block_size``, ``capacity_bytes``, ``pinned_capacity_bytes``,
    ``default_ttl_s``: the cache's (unused with a shared cache). ``max_batch``: decode rows per
    step, a request with ``n`` choices taking ``n`` (own runner); on both runners also the
    largest ``n``. ``max_wait_s``: how long a waiting request may be passed over.
    ``kv_reserve_tokens``: KV pool room for running requests beyond the cache's budget (default
    4x the context). ``reasons_bytes``: memory for explaining misses, taken from
    ``capacity_bytes`` (default: ``DEFAULTS.reasons_bytes``, at most an eighth of it; 0: none).
    ``miss_reasons`` False: no reason per request at all (a benchmark's baseline).
    ``verify_rate``: the share of hits the live exactness audit recomputes and compares
    (``engine/serving/verify.py``; own runner with the cache on; 0: only ``Engine.verify``).
    ``weights``: ``float`` (the model's weights in ``dtype``) or ``q4`` (a GGUF's own Q4_1
    groups through the int4 kernel, own runner on CPU: see ``engine/quant.py``)."""

    runner: str = "auto"
    enable_cache: bool = True
    block_size: int = DEFAULTS.block_size
    prefill_chunk: int | None = None  # None: DEFAULT_PREFILL_CHUNK
    dtype: str | None = None
    capacity_bytes: int = DEFAULTS.capacity_bytes
    pinned_capacity_bytes: int = DEFAULTS.pinned_capacity_bytes
    default_ttl_s: float = DEFAULTS.default_ttl_s
    threads: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    kv_reserve_tokens: int | None = None  # None: 4x the context
    reasons_bytes: int | None = None  # None: DEFAULTS.reasons_bytes, at most an eighth of the capacity
    miss_reasons: bool = True
    verify_rate: float = 0.0
    weights: str = "auto"  # 4-bit weights read in place where they give the float model's bits

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or DEFAULT_PREFILL_CHUNK

    def make_cache(self, block_size: int, clock: Any) -> PrefixCache:
        """The engine's own cache, as these settings say."""
        reasons_bytes = self.reasons_bytes
        if reasons_bytes is None:
            reasons_bytes = min(DEFAULTS.reasons_bytes, self.capacity_bytes // 8)
        return PrefixCache(
            block_size=block_size,
            capacity_bytes=self.capacity_bytes,
            pinned_capacity_bytes=self.pinned_capacity_bytes,
            default_ttl_s=self.default_ttl_s,
            clock=clock,
            reasons_bytes=reasons_bytes if self.miss_reasons else 0,
            explain=self.miss_reasons,
        )

    @classmethod
    def of(cls, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
        """``config`` (default: the defaults) with ``options`` (field names) replacing fields."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        base = config or cls()
        if not options:
            return base
        values = {name: getattr(base, name) for name in names}
        values.update(options)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a request worker needs to know beyond its runner, pool and cache."""

    block_size: int
    prefill_chunk: int  # own runner: the step's token budget; HF runner: the forward pass size
    alignment: int  # where a hit may end (tokens)
    fingerprint: str  # the runner's cache namespace fingerprint
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    reserve_blocks: int = 0  # own runner: pool blocks for running requests


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's counters: prompt tokens prefilled (computed, not read; once per request
    whatever its n), steps run, decode rows computed, seconds in steps (own runner: the rest are
    0), requests waiting and running, pool blocks reserved and decode rows taken by them."""

    prefilled_tokens: int = 0
    steps: int = 0
    decoded_rows: int = 0
    step_s: float = 0.0
    waiting: int = 0
    running: int = 0
    reserved_blocks: int = 0
    rows: int = 0
