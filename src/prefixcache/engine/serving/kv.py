"""Cache blocks <-> the model's ``past_key_values`` (a transformers ``DynamicCache``).

One block's payload is one contiguous tensor::

    # [layers, 2, kv_heads, B, head_dim]   (index 0 = keys, 1 = values), compute dtype

Storing the compute dtype is required for exactness: a downcast block would give different
attention scores than recomputing it. The engine never hands the cache a view of a live
DynamicCache tensor: a payload is its own copy, so evicting a block frees its bytes and
the request's cache can keep growing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def payload_nbytes(payload: torch.Tensor) -> int:
    return payload.nelement() * payload.element_size()


class Scratch:
    """A reusable buffer that hit blocks are assembled into, owned by one worker thread.

    Assembling a 2,048-token hit copies ~94 MB (SmolLM2, float32); into a fresh tensor that
    costs ~30 ms, mostly first-touch page faults, against ~9 ms into memory already mapped.
    The buffer only needs to live until the request's first forward pass, which concatenates
    the new KV onto it (``DynamicLayer.update``) and so leaves the cache holding new tensors:
    the next request on the same thread may then overwrite it. Not shared between threads.
    """

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A view of the buffer with ``shape`` = [layers, 2, kv_heads, T, head_dim], growing it
        (to the next power of two tokens) when it is too small or of another kind."""
        buf = self.buf
        tokens = shape[3]
        if (
            buf is None
            or buf.shape[3] < tokens
            or buf.shape[:3] != shape[:3]
            or buf.shape[4] != shape[4]
            or buf.dtype != dtype
            or buf.device != torch.device(device)
        ):
            cap = 1 << max(tokens - 1, 1).bit_length()
            buf = self.buf = torch.empty((*shape[:3], cap, shape[4]), dtype=dtype, device=device)
        return buf[:, :, :, :tokens]


def build_cache(runner: Any, payloads: Sequence[torch.Tensor], scratch: Scratch | None = None) -> Any:
    """A DynamicCache holding the concatenated KV of ``payloads`` (blocks in prompt order).

    The blocks are copied once, into ``scratch`` when given (see :class:`Scratch`: the caller
    runs the first forward before reusing it) or into a new tensor; each layer gets views of
    that memory (no further copy): the first forward concatenates the new KV onto them anyway.
    """
    cache = runner.new_cache()
    if not payloads:
        return cache
    first = payloads[0]
    B = first.shape[3]
    shape = (*first.shape[:3], B * len(payloads), first.shape[4])
    if scratch is None:
        full = torch.cat(list(payloads), dim=3).to(runner.device)  # [layers, 2, kv_heads, T, head_dim]
    else:
        full = scratch.take(shape, first.dtype, runner.device)
        for i, p in enumerate(payloads):
            full[:, :, :, i * B : (i + 1) * B].copy_(p)
    for layer_idx, layer in enumerate(cache.layers):
        keys = full[layer_idx, 0].unsqueeze(0)  # [1, kv_heads, T, head_dim]
        values = full[layer_idx, 1].unsqueeze(0)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def slice_blocks(cache: Any, start: int, stop: int, block_size: int) -> list[torch.Tensor]:
    """Payloads of the full blocks covering token positions ``[start, stop)`` of ``cache``.

    ``start`` and ``stop`` are multiples of ``block_size``. Each payload is a fresh contiguous
    tensor [layers, 2, kv_heads, B, head_dim] on the CPU-or-device of the model.
    """
    if start % block_size or stop % block_size:
        raise ValueError(f"block range [{start}, {stop}) is not aligned to {block_size}")
    if stop <= start:
        return []
    # One small stack per block straight from the layers' tensors: a single copy of the data,
    # and each copy (~0.7 MB for SmolLM2) is too small for torch to split across threads. One
    # big stack + per-block clones copied twice and, on a loaded machine, spent 25x longer
    # in OpenMP barriers (1.7 s instead of 0.07 s for 2,048 tokens).
    layers = cache.layers
    shape = (len(layers), 2, *layers[0].keys.shape[1:2], block_size, layers[0].keys.shape[-1])
    out = []
    for s in range(start, stop, block_size):
        parts = []
        for layer in layers:
            parts.append(layer.keys[0, :, s : s + block_size])
            parts.append(layer.values[0, :, s : s + block_size])
        out.append(torch.stack(parts).view(shape))  # [layers, 2, kv_heads, B, head_dim]
    return out
