"""Routing keys and the stateless routing choices, shared by the router that ships
(:mod:`prefixcache.router`) and the simulator's model of it (``prefixcache simulate --routing``),
so that the simulator predicts the router's placements. Stdlib only: no torch, no numpy.

* A request's prefix is a chain of hashes over its leading pieces, ``h[i] = sha256(h[i-1] ||
  piece i)`` from a root of the tenant's credential (and the client's ``prompt_cache_key``, when
  it sent one), cut to 32 hex digits (:func:`chunk_chain`). The router's pieces are 256-character
  chunks of a canonical rendering of the request (it has no tokenizer); the simulator's are the
  trace's token blocks (a trace has no text). The same function hashes both.
* The affinity key is the chunk at a fixed depth (:func:`affinity_index`), or a hash of the
  explicit ``prompt_cache_key`` (:func:`explicit_affinity`).
* ``prefix-affinity`` orders the replicas by rendezvous hashing of that key over the replicas'
  names (:func:`rendezvous_order`); ``round-robin`` starts at replica 0 and rotates;
  ``random`` draws with Python's ``random.Random(seed)`` (:func:`random_pick`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence

__all__ = [
    "POLICIES",
    "affinity_index",
    "chain_root",
    "chunk_chain",
    "explicit_affinity",
    "random_pick",
    "rendezvous_order",
]

#: Every routing policy, the router's and the simulator's alike.
POLICIES = ("round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware")

_ROOT_LABEL = b"prefixcache-router\x00"


def chain_root(credential: str, explicit: str | None = None) -> bytes:
    """The chain's root: the tenant's credential (tenants never share cache entries, so routing
    them together gains nothing), then the explicit ``prompt_cache_key`` if any."""
    root = hashlib.sha256(_ROOT_LABEL + credential.encode()).digest()
    if explicit is not None:
        root = hashlib.sha256(root + b"key\x00" + explicit.encode()).digest()
    return root


def chunk_chain(root: bytes, pieces: Iterable[bytes]) -> list[str]:
    """Chained hashes of ``pieces`` from ``root`` (32 hex digits each): two requests share entry
    ``i`` exactly when they share the root and pieces ``0..i``."""
    out: list[str] = []
    prev = root
    for piece in pieces:
        prev = hashlib.sha256(prev + piece).digest()
        out.append(prev.hex()[:32])
    return out


def affinity_index(chunks: int, affinity_chunks: int) -> int:
    """Which chunk is the affinity key: the one ``affinity_chunks`` deep, or the last of a shorter
    prompt (``chunks`` >= 1)."""
    return min(chunks, max(1, affinity_chunks)) - 1


def explicit_affinity(credential: str, explicit: str) -> str:
    """The affinity key of a request that names its group (``prompt_cache_key``)."""
    text = b"explicit\x00" + credential.encode() + b"\x00" + explicit.encode()
    return hashlib.sha256(text).hexdigest()[:32]


def rendezvous_order(key: str, names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in highest-random-weight order for ``key``: stable across processes,
    and when one name goes only its keys move. Ties (equal weights) keep the given order."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{key}|{names[i]}".encode(), digest_size=8).digest()

    return sorted(range(len(names)), key=weight, reverse=True)


def random_pick(rng: random.Random, count: int) -> int:
    """The ``random`` policy's draw among ``count`` replicas."""
    return rng.randrange(count)
