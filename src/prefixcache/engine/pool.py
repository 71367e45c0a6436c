"""The KV pool: one preallocated tensor of fixed-size blocks, shared by running requests and the cache.

    pool = KVPool(layers=30, kv_heads=3, head_dim=64, block_size=16, num_blocks=4096, dtype=torch.float32)
    block = pool.alloc()           # a PoolBlock, or None when every block is in use
    pool.keys(layer)               # [kv_heads, num_blocks, B, head_dim]: what attention gathers from
    block.as_tensor()              # a copy, [layers, 2, kv_heads, B, head_dim] (tiers store this)
    pool.copy(block)               # a new block with the same KV (n > 1: each choice's own tail)

Layout: ``[layers, 2, kv_heads, num_blocks, B, head_dim]`` (index 0 = keys, 1 = values). Per
layer, keys and values are ``[kv_heads, num_blocks, B, head_dim]``, so gathering a sequence's
block table along dim 1 gives ``[kv_heads, T, head_dim]`` with no further copy.

**Ownership is explicit: the pool keeps the counts.** Each block is free, held by the cache
(one hold, while a run of the store keeps it as its payload) and/or held by running requests (one
hold per block table that reads it: a request's prompt table, each choice's, an audit check's).
:meth:`KVPool.alloc` hands out a block with one request hold, :meth:`KVPool.hold` adds one,
:meth:`KVPool.free` drops one; the cache's holds follow the store's listener events
(:meth:`KVPool.watch`: ``insert`` takes one, ``evict`` drops it). A block goes back to the free
list when its last hold goes, so a block the cache evicts while a request reads it is freed when
that request lets go. Nothing is freed by the garbage collector: a lost reference leaks, and
:meth:`KVPool.check_integrity` finds it (free + cache-held + request-held = every block).
A block the cache evicts goes to the far end of the free list, reused last: listeners that run
after the pool's (a tier demoting it) still read its KV.

Block 0 is never handed out: it stays zeros and pads block tables (its keys are masked; its
values must be finite because a masked score still multiplies them by an exact 0).
On the CPU the pool is an anonymous memory map: pages are zero until written and cost memory
only once touched, so a pool sized for a 2 GiB cache costs what is used.
"""

from __future__ import annotations

import mmap
import threading
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import torch


def pool_size(
    block_nbytes: int, cached_bytes: int | None, reserve_tokens: int | None, context_len: int, block_size: int
) -> tuple[int, int]:
    """(blocks, reserve): a pool for the cache's budget (``cached_bytes``, None: no cache), block
    0 and a reserve of ``reserve_tokens`` (default 4x the context) for running requests."""
    cached = cached_bytes // block_nbytes + 1 if cached_bytes is not None else 0
    reserve = -(-(reserve_tokens or 4 * context_len) // block_size)
    if reserve * block_size < context_len:
        raise ValueError(f"kv_reserve_tokens must be at least the context ({context_len})")
    return cached + reserve + 1, reserve


class PoolIntegrityError(AssertionError):
    """The pool's counts disagree with who holds its blocks (a leak, a double free, a lost hold)."""


class PoolBlock:
    """One allocation of a block of a :class:`KVPool` (a handle: the pool keeps its holds).

    A handle stays valid until its block is freed; the next allocation of the same index is a
    new handle, so :meth:`KVPool.live` tells a stale handle from a reused block."""

    __slots__ = ("index", "pool")

    def __init__(self, pool: KVPool, index: int) -> None:
        self.pool = pool
        self.index = index

    def __repr__(self) -> str:
        return f"PoolBlock({self.index})"

    @property
    def nbytes(self) -> int:
        return self.pool.block_nbytes

    def as_tensor(self) -> torch.Tensor:
        """A contiguous copy of this block's KV: ``[layers, 2, kv_heads, B, head_dim]``."""
        return self.pool.data[:, :, :, self.index].clone()


class KVPool:
    """A fixed number of KV blocks, allocated and freed in O(1) from a free list (thread-safe)."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (block 0 pads); got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (layers, 2, kv_heads, num_blocks, block_size, head_dim)
        numel = layers * 2 * kv_heads * num_blocks * block_size * head_dim
        elem = torch.empty((), dtype=dtype).element_size()
        self._map: mmap.mmap | None = None
        if self.device.type == "cpu":
            self._map = mmap.mmap(-1, numel * elem)  # anonymous: zero pages, committed when written
            self.data = torch.frombuffer(self._map, dtype=dtype, count=numel).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self.block_nbytes = numel * elem // num_blocks
        self._lock = threading.Lock()
        self._free = deque(range(num_blocks - 1, 0, -1))  # LIFO: reuse pages already touched
        self._live: list[PoolBlock | None] = [None] * num_blocks  # index -> its current handle
        self._holds = [0] * num_blocks  # request holds per block
        self._cached = bytearray(num_blocks)  # 1 while the cache holds the block
        self._adopting: set[int] = set()  # adopted for the cache, its insert event not seen yet
        self._errors: list[str] = []  # what the listener saw wrong (it cannot raise into the cache)

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def cache_held_blocks(self) -> int:
        return sum(self._cached)

    def alloc(self) -> PoolBlock | None:
        """A free block with one request hold (the caller's), or None when none is free."""
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
            block = self._live[index] = PoolBlock(self, index)
            self._holds[index] = 1
        return block

    def live(self, block: PoolBlock) -> bool:
        """Whether ``block`` is still allocated (not freed, its index not handed out again)."""
        return block.pool is self and self._live[block.index] is block

    def hold(self, block: PoolBlock) -> PoolBlock:
        """One more request hold on ``block`` (a live block of this pool); returns it."""
        with self._lock:
            if not self.live(block):  # refused: nothing changes
                raise PoolIntegrityError(f"hold of {block!r}, which is not allocated")
            self._holds[block.index] += 1
        return block

    def free(self, block: PoolBlock) -> None:
        """Drop one request hold on ``block``; it returns to the free list with its last hold."""
        with self._lock:
            index = block.index
            if not self.live(block) or self._holds[index] < 1:  # refused: nothing changes
                raise PoolIntegrityError(f"free of {block!r}, which holds nothing (a double free)")
            self._holds[index] -= 1
            if not self._holds[index] and not self._cached[index]:
                self._live[index] = None
                self._free.append(index)

    def free_all(self, blocks: Iterable[PoolBlock]) -> None:
        for block in blocks:
            self.free(block)

    def watch(self, store: Any) -> None:
        """Follow the cache's holds through ``store``'s listener events (a BlockStore)."""
        store.add_listener(self.on_cache_event)

    def on_cache_event(self, event: str, snapshot: Any) -> None:
        """The store's listener: a block of this pool stored (``insert``) or removed (``evict``)."""
        block = snapshot.payload
        if not isinstance(block, PoolBlock) or block.pool is not self:
            return
        with self._lock:
            index = block.index
            if not self.live(block):
                self._errors.append(f"the cache {event}s {block!r}, which is not allocated")
            elif event == "insert":
                self._adopting.discard(index)
                if self._cached[index]:
                    self._errors.append(f"the cache stores {block!r} twice")
                self._cached[index] = 1
            elif event == "evict":
                if not self._cached[index]:
                    self._errors.append(f"the cache evicts {block!r}, which it did not hold")
                self._cached[index] = 0
                if not self._holds[index]:
                    self._live[index] = None
                    self._free.appendleft(index)  # reused last: later listeners may still read it

    def check_integrity(self, cached: Iterable[Any] = (), held: Iterable[PoolBlock] = ()) -> None:
        """Prove that free + cache-held + request-held is every block, against the truth:
        ``cached``, the payloads the cache holds now (others than this pool's blocks are
        skipped), and ``held``, every request hold (one entry per block table reading a block).
        Raises :class:`PoolIntegrityError` saying what is wrong."""
        cache_truth = {b.index: b for b in cached if isinstance(b, PoolBlock) and b.pool is self}
        held = list(held)
        hold_truth = Counter(b.index for b in held)
        stale_holds = [b for b in held if not self.live(b)]
        with self._lock:
            problems = list(self._errors)
            free = list(self._free)
            free_set = set(free)
            if len(free_set) != len(free):
                problems.append("a block is on the free list twice")
            if 0 in free_set:
                problems.append("block 0 (padding) is on the free list")
            for index in sorted(self._adopting):
                problems.append(f"block {index} was adopted for the cache and never stored")
            for b in stale_holds:
                problems.append(f"a request reads {b!r}, which is not allocated")
            for index in range(1, self.num_blocks):
                block = self._live[index]
                holds, in_cache = self._holds[index], bool(self._cached[index])
                if index in free_set:
                    if block is not None or holds or in_cache:
                        problems.append(f"block {index} is free and also in use")
                    continue
                if index in self._adopting:
                    continue
                if block is None or (not holds and not in_cache):
                    problems.append(f"block {index} is neither free nor held by anyone (lost)")
                    continue
                if in_cache != (index in cache_truth):
                    problems.append(
                        f"block {index}: the pool counts it as "
                        + (
                            "cache-held; the cache does not hold it"
                            if in_cache
                            else "not cache-held; the cache holds it"
                        )
                    )
                elif in_cache and cache_truth[index] is not block:
                    problems.append(f"block {index}: the cache holds a stale handle of it")
                if holds != hold_truth.get(index, 0):
                    problems.append(
                        f"block {index}: {holds} request holds counted, {hold_truth.get(index, 0)} found"
                        + (" (a leaked hold)" if holds > hold_truth.get(index, 0) else "")
                    )
            for index in cache_truth:
                if index in free_set:
                    problems.append(f"block {index} is free but the cache holds it")
            accounted = len(free) + sum(1 for i in range(1, self.num_blocks) if self._live[i] is not None)
            if accounted != self.num_blocks - 1:
                problems.append(f"{accounted} blocks accounted for, of {self.num_blocks - 1}")
        if problems:
            raise PoolIntegrityError("KV pool integrity: " + "; ".join(problems[:10]))

    def copy(self, block: PoolBlock) -> PoolBlock | None:
        """A new block (one request hold) holding a bitwise copy of ``block``'s KV (every slot),
        or None when no block is free. Choices of one request share their prompt's full blocks and each get a
        copy of its last, partial block, whose free slots their own tokens then fill."""
        new = self.alloc()
        if new is not None:
            self.data[:, :, :, new.index].copy_(self.data[:, :, :, block.index])
        return new

    def copy_in(self, payload: Any) -> PoolBlock | None:
        """A payload held elsewhere (a tier's tensor ``[layers, 2, kv_heads, B, head_dim]``,
        another pool's block) copied into a new block with one request hold; None when it cannot
        be (no free block, another layout)."""
        tensor = payload.as_tensor() if isinstance(payload, PoolBlock) else payload
        if not isinstance(tensor, torch.Tensor) or tensor.shape != self.data[:, :, :, 0].shape:
            return None
        if tensor.dtype != self.dtype:
            return None
        block = self.alloc()
        if block is not None:
            self.data[:, :, :, block.index].copy_(tensor)
        return block

    def adopt(self, payload: Any) -> Any:
        """A payload promoted from a tier as a block of this pool, for the cache to store (the
        cache's ``adopt``): a PoolBlock of this pool as it is, else a copy in a new block, whose
        hold passes to the cache (its ``insert`` event). Returns the payload unchanged when it
        cannot be adopted (no free block, another layout)."""
        if isinstance(payload, PoolBlock) and payload.pool is self:
            return payload
        block = self.copy_in(payload)
        if block is None:
            return payload
        with self._lock:  # the cache takes the block over: its insert event takes the hold
            self._holds[block.index] = 0
            self._adopting.add(block.index)
        return block

    def settle_adopted(self) -> int:
        """Free the blocks :meth:`adopt` made that the cache did not store after all (a promotion
        that found no room). Call after the cache call that promoted (``match``). Returns how many."""
        with self._lock:
            left = sorted(self._adopting)
            self._adopting.clear()
            for index in left:
                self._live[index] = None
                self._free.append(index)
        return len(left)
