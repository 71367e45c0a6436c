"""Chained block keys of trace requests, resuming from the cached chain state of a shared prefix.

Trace prompts are tuples of interned segments (``Trace.parts``): a system prompt shared by many
requests, then each request's own tail. The audit and the simulator both need every request's
block keys; :class:`KeyChains` hashes each shared prefix once, so a request costs hashing only
its unique tail.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from prefixcache.cache import block_keys

__all__ = ["KeyChains", "paused_gc"]


class KeyChains:
    """Block keys of ``parts`` tuples, resuming from cached chain states of their prefixes.

    A state is (keys so far, leftover tokens short of a block). States of proper prefixes are
    kept (FIFO, at most ``max_states``), so a system prompt shared by many requests is hashed once.
    """

    def __init__(self, segments: list[np.ndarray], block_size: int, max_states: int = 50_000) -> None:
        self.segments = segments
        self.B = block_size
        self.max_states = max_states
        # An OrderedDict: popping the oldest is O(1) (a plain dict's next(iter()) walks over the
        # holes that deletions from its front leave, which made this quadratic).
        self._states: OrderedDict[tuple[bytes, tuple[int, ...]], tuple[list[bytes], np.ndarray]] = OrderedDict()
        self._empty = np.zeros(0, dtype=np.uint32)

    def keys(self, root: bytes, parts: tuple[int, ...]) -> list[bytes]:
        states = self._states
        k = len(parts) - 1
        state = None
        while k > 0:
            state = states.get((root, parts[:k]))
            if state is not None:
                break
            k -= 1
        keys, tail = state if state is not None else ([], self._empty)
        for j in range(k, len(parts)):
            keys, tail = self._extend(root, keys, tail, self.segments[parts[j]])
            if j < len(parts) - 1:
                if len(states) >= self.max_states:
                    states.popitem(last=False)
                states[(root, parts[: j + 1])] = (keys, tail)
        return keys

    def _extend(self, root: bytes, keys: list[bytes], tail: np.ndarray, seg: np.ndarray) -> tuple[list[bytes], np.ndarray]:
        data = np.concatenate((tail, seg)) if len(tail) else seg
        full = len(data) // self.B
        if not full:
            return keys, data
        new = block_keys(data, keys[-1] if keys else root, self.B, limit=full)
        return keys + new, data[full * self.B :]


@contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic cyclic garbage collection inside (restored after).

    A replay allocates tens of millions of short-lived objects (blocks, matches, key lists)
    and forms no reference cycles per request, so the collector's periodic passes over every
    live block and dict are pure overhead (about a fifth of the simulator's time). Anything
    cyclic made inside is collected normally once the block ends.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
