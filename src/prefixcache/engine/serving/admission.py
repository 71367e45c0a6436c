"""Admission: a request's fields checked and made a :class:`Request`; for the batch scheduler,
which waiting request runs next and whether it fits.

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
from prefixcache.cache.keys import BlockHash, Namespace, pack_tokens
from prefixcache.engine.serving.sampling import InvalidRequestError, SamplingParams
from prefixcache.engine.serving.sequence import SequenceGroup
from prefixcache.engine.serving.verify import Auditor
from prefixcache.engine.serving.worker import Job
from prefixcache.engine.types import MAX_TOP_LOGPROBS, PromptTooLongError, Request


def check_request_fields(
    params: SamplingParams, *, max_n: int, max_tokens: Any, n: Any, logprobs: Any, **_: Any
) -> None:
    """Raise InvalidRequestError for fields no engine could run (before the prompt is read)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise InvalidRequestError(
            f"n must be an integer from 1 to {max_n} (this engine's max_batch); got {n!r}"
        )
    if logprobs is not None and (
        not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
    ):
        raise InvalidRequestError(
            f"logprobs must be None or an integer from 0 to {MAX_TOP_LOGPROBS}; got {logprobs!r}"
        )
    params.validate()


def make_request(
    ids: list[int],
    params: SamplingParams,
    *,
    context_len: int,
    max_tokens: int,
    stop: str | Iterable[str] | None,
    tenant: str,
    salt: bytes | str,
    ttl_s: float | None,
    ttl_plan: Iterable[tuple[int, float]] | None,
    return_logits: bool,
    n: int,
    logprobs: int | None,
) -> Request:
    """The :class:`Request` for prompt ``ids`` (checked: :func:`check_request_fields` first),
    or PromptTooLongError / InvalidRequestError."""
    if len(ids) + max_tokens > context_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together "
            f"{len(ids) + max_tokens}, over the model's context of {context_len} tokens; "
            "shorten the prompt or lower max_tokens"
        )
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if ttl_s is not None and not ttl_s > 0:
        raise InvalidRequestError(f"ttl_s must be > 0 seconds; got {ttl_s!r}")
    return Request(
        ids=ids,
        max_tokens=max_tokens,
        params=params,
        stop=stops,
        tenant=tenant,
        salt=salt.encode() if isinstance(salt, str) else bytes(salt),
        ttl_s=ttl_s,
        ttl_plan=list(ttl_plan) if ttl_plan else None,
        return_logits=return_logits,
        n=n,
        logprobs=logprobs,
    )


def prefetch_blocks(
    cache: PrefixCache, ns: Namespace, request: Request, alignment: int, auditor: Auditor | None
) -> None:
    """Bring the request's blocks that memory lacks up from the tiers, on the calling (the
    request's) thread and outside the cache's lock, before the step thread admits it."""
    if not cache.tiers or cache.promote_in_match:
        return  # (promote_in_match set back on: match reads the tiers, under the lock)
    request.packed = pack_tokens(request.ids)
    request.keys = cache.block_keys(request.ids, ns)
    if auditor is not None and auditor.holds_back(request.keys):
        return  # a block it would read was found wrong: the step thread waits for its removal
    cache.prefetch(
        None,
        ns,
        align_tokens=alignment,
        ttl_s=request.ttl_s,
        ttl_plan=request.ttl_plan,
        keys=request.keys,
        packed=request.packed,
    )


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


__all__ = ["Admission", "check_request_fields", "make_request"]
