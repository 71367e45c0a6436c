"""The KV pool: one preallocated tensor of fixed-size blocks, shared by running requests and the cache.

    pool = KVPool(layers=30, kv_heads=3, head_dim=64, block_size=16, num_blocks=4096, dtype=torch.float32)
    block = pool.alloc()           # a PoolBlock, or None when every block is in use
    pool.keys(layer)               # [kv_heads, num_blocks, B, head_dim]: what attention gathers from
    block.as_tensor()              # a copy, [layers, 2, kv_heads, B, head_dim] (tiers store this)
    pool.copy(block)               # a new block with the same KV (n > 1: each choice's own tail)

Layout: ``[layers, 2, kv_heads, num_blocks, B, head_dim]`` (index 0 = keys, 1 = values). Per
layer, keys and values are ``[kv_heads, num_blocks, B, head_dim]``, so gathering a sequence's
block table along dim 1 gives ``[kv_heads, T, head_dim]`` with no further copy.

**Ownership is reference counting.** A :class:`PoolBlock` returns its index to the free list when
the last Python reference to it goes: a running request's block table holds one, and a block it
commits to the cache is the cache's payload (the store's run holds it). A block the cache evicts
while no request reads it is free at once; one a request still reads is freed when that request
ends. Nothing else frees blocks, so no block is ever freed twice or while read.

Block 0 is never handed out: it stays zeros and pads block tables (its keys are masked; its
values must be finite because a masked score still multiplies them by an exact 0).
On the CPU the pool is an anonymous memory map: pages are zero until written and cost memory
only once touched, so a pool sized for a 2 GiB cache costs what is used.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Any

import torch


class PoolBlock:
    """One block of a :class:`KVPool`; freed when the last reference goes (see the module doc)."""

    __slots__ = ("index", "pool", "__weakref__")

    def __init__(self, pool: KVPool, index: int) -> None:
        self.pool = pool
        self.index = index

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the pool may be gone first
            self.pool._release(self.index)

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
        self._free = list(range(num_blocks - 1, 0, -1))  # LIFO: reuse pages already touched

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

    def alloc(self) -> PoolBlock | None:
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
        return PoolBlock(self, index)

    def _release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    def copy(self, block: PoolBlock) -> PoolBlock | None:
        """A new block holding a bitwise copy of ``block``'s KV (every slot), or None when no
        block is free. Choices of one request share their prompt's full blocks and each get a
        copy of its last, partial block, whose free slots their own tokens then fill."""
        new = self.alloc()
        if new is not None:
            self.data[:, :, :, new.index].copy_(self.data[:, :, :, block.index])
        return new

    def adopt(self, payload: Any) -> Any:
        """A cache payload as a block of this pool: a PoolBlock of this pool as it is, a tensor
        ``[layers, 2, kv_heads, B, head_dim]`` (from a tier) copied into a new block. Returns the
        payload unchanged when it cannot be adopted (no free block, another layout)."""
        if isinstance(payload, PoolBlock) and payload.pool is self:
            return payload
        tensor = payload.as_tensor() if isinstance(payload, PoolBlock) else payload
        if not isinstance(tensor, torch.Tensor) or tensor.shape != self.data[:, :, :, 0].shape:
            return payload
        if tensor.dtype != self.dtype:
            return payload
        block = self.alloc()
        if block is None:
            return payload
        self.data[:, :, :, block.index].copy_(tensor)
        return block
