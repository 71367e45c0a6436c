"""The live exactness audit: a sampled hit is recomputed with the cache bypassed and compared.

    auditor = Auditor(rate=0.01)          # BatchWorker.auditor; Engine(verify_rate=...) sets it up
    auditor.counts()                      # {"equal": ..., "differ": ..., "skipped": ...}
    auditor.differences                   # the last differences found (namespace, block, position)
    auditor.acknowledge()                 # an operator has seen them: no longer degraded

A hit's promise is that its logits are bitwise what recomputing the prompt gives. The scheduler
hands every request whose prompt read cached blocks to :meth:`Auditor.sample` with the logits row
its sampler received; with probability ``rate`` (or always, for :meth:`Engine.verify
<prefixcache.engine.engine.Engine.verify>`), the check is queued. Once the request has ended (its
cache references are released), the prompt is recomputed from position 0 into private pool
blocks, in the spare capacity of the engine's steps: only while no request waits for admission,
at most ``chunk`` tokens a step while requests run (the whole step budget when the engine is
otherwise idle), and aborted, to restart later, if a waiting request needs its KV reservation.
Then two comparisons, bit for bit:

- the recomputed last row's logits against the row the sampler received;
- each hit block's KV (every layer, keys and values) against the recomputed block at that place.

A difference is logged (tenant, namespace, block, first differing position), counted, kept for
``GET /v1/cache/verify``, and the blocks from the first differing one on (all the hit's blocks
when only the logits differ) are removed from memory and from the tiers; requests that would read
them wait until they are gone, so the next one recomputes. The engine is *degraded* until
:meth:`acknowledge`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from prefixcache.cache import PrefixCache
from prefixcache.engine.config import DEFAULT_VERIFY_RATE
from prefixcache.engine.llama import Segment
from prefixcache.engine.pool import KVPool, PoolBlock
from prefixcache.engine.serving.sequence import SequenceGroup
from prefixcache.engine.types import Request


class BatchWorker(Protocol):
    """What the audit reads and takes of the batch scheduler (``engine/serving/scheduler.py``)."""

    waiting: list[Any]
    running: list[SequenceGroup]
    reserved: int
    reserve_blocks: int
    block_size: int
    pool: KVPool
    cache: PrefixCache | None

    def namespace(self, tenant: str, salt: bytes) -> Any: ...

    def need(self, req: Request) -> int: ...

    def alloc(self) -> PoolBlock: ...


log = logging.getLogger(__name__)

#: Checks waiting for spare capacity; a sampled hit beyond these is counted as skipped.
MAX_PENDING = 4
#: Tokens a step may spend on a check while requests run.
DEFAULT_CHUNK = 64
#: Differences kept for the operator (the newest).
MAX_DIFFERENCES = 32


@dataclass(frozen=True, slots=True)
class Difference:
    """A hit that did not match its recomputation. ``block``: the first differing block (its
    index in the prompt), ``position``: the first differing token position, both None when the
    KV of every hit block matched and only the logits differed."""

    tenant: str
    namespace: str  # the namespace root, hex (first 16 digits)
    block: int | None
    position: int | None
    logits_equal: bool
    kv_equal: bool
    cached_tokens: int
    prompt_tokens: int
    removed_blocks: int
    tier_entries_removed: dict[str, int]
    at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "namespace": self.namespace,
            "block": self.block,
            "position": self.position,
            "logits_equal": self.logits_equal,
            "kv_equal": self.kv_equal,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "removed_blocks": self.removed_blocks,
            "tier_entries_removed": dict(self.tier_entries_removed),
            "at": self.at,
        }


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """One check's outcome: ``result`` is "equal", "differ", "not_cached" (the prompt read no
    cached block: nothing to compare) or "skipped" (a hit block left the cache first)."""

    result: str
    prompt_tokens: int
    cached_tokens: int
    difference: Difference | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "result": self.result,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.difference is not None:
            out["difference"] = self.difference.as_dict()
        return out


@dataclass(slots=True)
class _Check:
    ids: list[int]
    ns: Any
    keys: list[Any]  # the hit blocks' keys, in prompt order
    refs: list[PoolBlock]  # the hit blocks' handles (live while cached or read; not held while pending)
    logits: torch.Tensor  # the row the sampler received
    match: Any  # the request's Match: the check starts once it is released
    future: Future[VerifyResult] | None = None
    held: list[PoolBlock] = field(default_factory=list)  # strong references while checking
    blocks: list[PoolBlock] = field(default_factory=list)  # the recomputation's own blocks
    computed: int = 0
    reserved: int = 0
    block_size: int = 16

    @property
    def cached_tokens(self) -> int:
        return len(self.keys) * self.block_size


class Auditor:
    """The audit's state, driven by one :class:`BatchWorker` on its thread (see the module doc).
    Counters and differences are read from any thread."""

    def __init__(self, rate: float = 0.0, *, chunk: int = DEFAULT_CHUNK, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"verify rate must be in [0, 1]; got {rate}")
        if chunk < 1:
            raise ValueError(f"verify chunk must be >= 1; got {chunk}")
        self.rate = rate
        self.chunk = chunk
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._pending: deque[_Check] = deque()
        self._active: _Check | None = None
        self._doomed: list[tuple[Any, list[Any]]] = []  # (namespace, keys) still to remove
        self._counts = {"equal": 0, "differ": 0, "skipped": 0}
        self._differences: deque[Difference] = deque(maxlen=MAX_DIFFERENCES)
        self._unacknowledged = 0

    # ------------------------------------------------------------------ read side (any thread)
    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def differences(self) -> list[Difference]:
        with self._lock:
            return list(self._differences)

    @property
    def degraded(self) -> bool:
        """A difference was found and no operator has acknowledged it yet."""
        with self._lock:
            return self._unacknowledged > 0

    def acknowledge(self) -> int:
        """Clear the degraded state; returns how many differences it covered."""
        with self._lock:
            seen, self._unacknowledged = self._unacknowledged, 0
            return seen

    def as_dict(self, tenant: str | None = None) -> dict[str, Any]:
        """The audit for ``GET /v1/cache/verify``: rate, counts, state and the differences
        (``tenant``: only that tenant's)."""
        with self._lock:
            diffs = [d.as_dict() for d in self._differences if tenant is None or d.tenant == tenant]
            return {
                "rate": self.rate,
                "verified": dict(self._counts),
                "degraded": self._unacknowledged > 0,
                "differences": diffs,
            }

    # ------------------------------------------------------------------ worker side
    @property
    def busy(self) -> bool:
        """A check is queued or running (the worker keeps stepping for it)."""
        return self._active is not None or bool(self._pending) or bool(self._doomed)

    def sample(self, worker: BatchWorker, group: SequenceGroup, logits: torch.Tensor) -> None:
        """The prompt of ``group`` is done and ``logits`` is its last row: queue a check when its
        prompt read cached blocks and it is drawn (or asked for)."""
        future = group.request.verify
        m = group.match
        cached = m.cached_blocks if m is not None else 0
        if future is None and (not cached or self.rate <= 0.0 or self._rng.random() >= self.rate):
            return
        if not cached:
            future.set_result(VerifyResult("not_cached", group.prompt_len, 0))
            return
        if future is None and len(self._pending) >= MAX_PENDING:
            self._count("skipped")
            return
        check = _Check(
            ids=list(group.request.ids),
            ns=worker.namespace(group.request.tenant, group.request.salt),
            keys=list(group.keys[:cached]),
            refs=list(group.blocks[:cached]),
            logits=logits.detach().clone(),
            match=m,
            future=future,
            block_size=worker.block_size,
        )
        self._pending.append(check)

    def before_admit(self, worker: BatchWorker) -> None:
        """Retry removals that readers held back; give up a running check's reservation when a
        waiting request needs it (the check restarts later)."""
        if self._doomed:
            self._remove_doomed(worker)
        check = self._active
        if check is not None and worker.waiting:
            free = worker.reserve_blocks - worker.reserved
            if any(free < worker.need(job.request) <= free + check.reserved for job in worker.waiting):
                self._abort(worker, check)
                self._pending.appendleft(check)

    def holds_back(self, keys: list[Any]) -> bool:
        """A request whose blocks include one found wrong and not yet removed waits."""
        if not self._doomed:
            return False
        wanted = set(keys)
        return any(not wanted.isdisjoint(doomed) for _, doomed in self._doomed)

    def segments(self, worker: BatchWorker, budget: int) -> list[Segment]:
        """This step's share of the running check (maybe none): spare budget only."""
        if worker.waiting or budget <= 0:
            return []
        check = self._active or self._start(worker)
        if check is None:
            return []
        if worker.running:
            budget = min(budget, self.chunk)
        n = len(check.ids)
        stop = min(n, check.computed + budget)
        B = worker.block_size
        try:
            while len(check.blocks) * B < stop:
                check.blocks.append(worker.alloc())
        except RuntimeError:  # (the reservation makes this unreachable) give up this check, not the loop
            log.exception("exactness audit: no KV block for a check")
            self._abort(worker, check)
            self._finish(check, VerifyResult("skipped", n, check.cached_tokens))
            return []
        seg = Segment(
            check.ids[check.computed : stop],
            check.computed,
            [b.index for b in check.blocks],
            want_logits=stop == n,
        )
        check.computed = stop
        return [seg]

    def take(self, worker: BatchWorker, segments: list[Segment], logits: torch.Tensor) -> None:
        """After the step: ``logits`` holds the rows of ``segments`` (this auditor's) that want them."""
        check = self._active
        if check is None or not segments or not segments[-1].want_logits:
            return
        self._active = None
        try:
            self._compare(worker, check, logits[0])
        finally:
            self._abort(worker, check)

    def holdings(self) -> list[PoolBlock]:
        """The pool blocks the running check holds (its own and the hit's), one entry per hold."""
        check = self._active
        return [*check.blocks, *check.held] if check is not None else []

    def step_failed(self, worker: BatchWorker) -> None:
        check = self._active
        if check is not None:
            self._abort(worker, check)
            self._finish(check, VerifyResult("skipped", len(check.ids), check.cached_tokens))

    # ------------------------------------------------------------------ internals
    def _count(self, result: str) -> None:
        with self._lock:
            self._counts[result] += 1

    def _start(self, worker: BatchWorker) -> _Check | None:
        for _ in range(len(self._pending)):
            check = self._pending.popleft()
            if not check.match.released:  # its request still runs: later
                self._pending.append(check)
                continue
            held = check.refs
            if not all(worker.pool.live(b) for b in held):  # a hit block left the cache: nothing to compare
                self._finish(check, VerifyResult("skipped", len(check.ids), check.cached_tokens))
                continue
            B = worker.block_size
            need = len(held) + -(-len(check.ids) // B)
            if worker.reserved + need > worker.reserve_blocks:
                self._pending.appendleft(check)
                return None
            check.held = [worker.pool.hold(b) for b in held]
            check.reserved = need
            check.computed = 0
            worker.reserved += need
            self._active = check
            return check
        return None

    def _abort(self, worker: BatchWorker, check: _Check) -> None:
        """Give back what a check holds (its blocks, its reservation)."""
        if self._active is check:
            self._active = None
        worker.reserved -= check.reserved
        check.reserved = 0
        worker.pool.free_all(check.blocks)
        worker.pool.free_all(check.held)
        check.blocks = []
        check.held = []
        check.computed = 0

    def _finish(self, check: _Check, result: VerifyResult) -> None:
        self._count(result.result)
        if check.future is not None and not check.future.done():
            check.future.set_result(result)

    def _compare(self, worker: BatchWorker, check: _Check, logits: torch.Tensor) -> None:
        logits_equal = _bitwise_equal(logits, check.logits)
        data = worker.pool.data
        B = worker.block_size
        block = position = None
        for i, (hit, mine) in enumerate(zip(check.held, check.blocks, strict=False)):
            a, b = data[:, :, :, hit.index], data[:, :, :, mine.index]
            if not _bitwise_equal(a, b):
                rows = (_bits(a) != _bits(b)).transpose(0, 3).reshape(B, -1).any(dim=1)
                block, position = i, i * B + int(rows.nonzero()[0])
                break
        if logits_equal and block is None:
            self._finish(check, VerifyResult("equal", len(check.ids), check.cached_tokens))
            return
        first = block if block is not None else 0
        doomed = check.keys[first:]
        cache = worker.cache
        assert cache is not None  # (the audit runs only with the cache on)
        removed, left = cache.invalidate(check.ns, doomed)
        tiers = cache.remove_tier_keys(check.ns, doomed)
        if left:
            self._doomed.append((check.ns, doomed))
        diff = Difference(
            tenant=check.ns.tenant,
            namespace=bytes(check.ns.root).hex()[:16],
            block=block,
            position=position,
            logits_equal=logits_equal,
            kv_equal=block is None,
            cached_tokens=check.cached_tokens,
            prompt_tokens=len(check.ids),
            removed_blocks=removed,
            tier_entries_removed=tiers,
            at=time.time(),
        )
        log.error(
            "exactness audit: a cache hit differs from its recomputation (tenant %s, namespace %s, "
            "block %s, first differing position %s, logits %s, KV %s): %d blocks removed from memory, "
            "tier entries removed %s; /health is degraded until acknowledged (POST /v1/cache/verify/ack)",
            diff.tenant,
            diff.namespace,
            block,
            position,
            "equal" if logits_equal else "differ",
            "equal" if block is None else "differ",
            removed,
            tiers,
        )
        with self._lock:
            self._differences.append(diff)
            self._unacknowledged += 1
        self._finish(check, VerifyResult("differ", len(check.ids), check.cached_tokens, diff))

    def _remove_doomed(self, worker: BatchWorker) -> None:
        cache = worker.cache
        assert cache is not None  # (the audit runs only with the cache on)
        still = []
        for ns, keys in self._doomed:
            _, left = cache.invalidate(ns, keys)
            if left:
                pinned = [b for b in cache.snapshots(keys, missing_ok=True) if b.pin_count > 0]
                if len(pinned) == left:  # only pinned ones are left: nobody will release them
                    log.error("exactness audit: %d pinned blocks differ: unpin them to remove them", left)
                    continue
                still.append((ns, keys))
        self._doomed = still


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0 != 0.0 and NaN == NaN of the same payload)."""
    t = t.contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


__all__ = ["DEFAULT_VERIFY_RATE", "Auditor", "Difference", "VerifyResult"]
