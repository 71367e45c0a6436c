"""Admission for the batch scheduler: which waiting request runs next, and whether it fits.

    policy = Admission(block_size=16, context_len=2048, max_batch=16, reserve_blocks=512, ...)
    for job in policy.order(waiting, now, cache):      # overdue first, then longest cached prefix
        if policy.fits(job.request, rows, reserved): ...

The order, in preference: a request that has waited longer than ``max_wait_s`` (oldest first, so
nothing starves); then the longest cached prefix (SGLang's longest-prefix policy: it is cheapest
now and its blocks may be evicted later); then arrival order. A request fits when the decode rows
of its ``n`` choices and the pool blocks of its reservation are free; one whose reservation
exceeds the whole reserve could never fit and is refused when submitted (:meth:`validate`).
In-flight dedup: the keys of blocks running requests are prefilling and have not committed
(:meth:`inflight_keys`) make a request whose next uncached block is among them wait.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prefixcache.cache import PrefixCache
from prefixcache.cache.keys import BlockHash, pack_tokens
from prefixcache.engine.serving.sampling import InvalidRequestError
from prefixcache.engine.serving.sequence import SequenceGroup
from prefixcache.engine.serving.worker import Job
from prefixcache.engine.types import Request


class Admission:
    """The batch scheduler's admission policy (see the module doc). Holds no request state."""

    def __init__(
        self, *, block_size: int, context_len: int, max_batch: int, reserve_blocks: int, max_wait_s: float
    ) -> None:
        self.block_size = block_size
        self.context_len = context_len
        self.max_batch = max_batch
        self.reserve_blocks = reserve_blocks
        self.max_wait_s = max_wait_s

    def need(self, req: Request) -> int:
        """Pool blocks ``req`` reserves at admission (``SequenceGroup.blocks_needed``)."""
        return SequenceGroup.blocks_needed(req, self.block_size, self.context_len)

    def validate(self, req: Request) -> None:
        """A request whose reservation exceeds the whole reserve could never be admitted."""
        need = self.need(req)
        if need > self.reserve_blocks:
            raise InvalidRequestError(
                f"n={req.n} choices of up to {req.max_tokens} tokens need {need} KV blocks, more "
                f"than this engine reserves for running requests ({self.reserve_blocks}); lower n or "
                "max_tokens (or raise kv_reserve_tokens)"
            )

    def fits(self, req: Request, rows: int, reserved: int) -> bool:
        """Room for ``req`` now: decode rows for its choices and pool blocks for its reservation."""
        return rows + req.n <= self.max_batch and reserved + self.need(req) <= self.reserve_blocks

    def overdue(self, job: Job, now: float) -> bool:
        return now - job.submitted > self.max_wait_s

    def order(self, waiting: list[Job], now: float, cache: PrefixCache | None, namespace: Any) -> list[Job]:
        """``waiting`` in admission order. ``namespace(tenant, salt)``: a request's namespace."""
        many = cache is not None and len(waiting) > 1

        def priority(job: Job) -> tuple[int, int, float]:
            if self.overdue(job, now):
                return (0, 0, job.submitted)
            cached = 0
            if many:
                assert cache is not None
                keys, packed = self.keys(job, cache, namespace)
                cached = cache.cached_prefix(keys, packed)
            return (1, -cached, job.submitted)

        return sorted(waiting, key=priority)

    @staticmethod
    def keys(job: Job, cache: PrefixCache, namespace: Any) -> tuple[list[BlockHash], bytes]:
        """The request's block keys and packed tokens, computed once per job."""
        req: Request = job.request
        if req.keys is None:
            req.packed = pack_tokens(req.ids)
            req.keys = cache.block_keys(req.ids, namespace(req.tenant, req.salt))
        return req.keys, req.packed

    def inflight_keys(self, running: Iterable[SequenceGroup]) -> dict[BlockHash, SequenceGroup]:
        """Keys of the blocks that running requests are prefilling and have not committed yet."""
        out: dict[BlockHash, SequenceGroup] = {}
        for group in running:
            if group.prefilling and group.match is not None:
                for key in group.keys[group.committed // self.block_size :]:
                    out.setdefault(key, group)
        return out


__all__ = ["Admission"]
