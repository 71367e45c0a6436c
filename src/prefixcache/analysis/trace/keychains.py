"""Chained block keys of trace requests, resuming from the chain state of a shared prefix.

Trace prompts are tuples of interned segments (``Trace.parts``): a system prompt shared by many
requests, then each request's own tail. The audit and the simulator both need every request's
block keys; :class:`KeyChains` keeps the chain state of recent prompts (a trie over segment ids),
so a request costs only the blocks after its longest already-seen prefix of segments.

Fingerprints instead of SHA-256 (a design decision). The ops tools' block keys never leave the
process (nothing persists them, nothing compares them with an engine's keys), and the store
verifies every block's tokens and parent on a hit, so by default :class:`KeyChains` names blocks
with a fast chained fingerprint rather than the real keys of :mod:`prefixcache.cache.keys`:

* a key is 16 bytes, two 64-bit lanes ``h_l(L) = root_l + sum_{p < L} mix(t_p) * P_l**p (mod 2**64)``
  taken at every block boundary ``L = B, 2B, ...`` of the prompt ``t``: ``root_l`` comes from the
  namespace root (its SHA-256); ``mix`` is a bijective 64-bit mix of a token id (add a constant
  above 2**32, so no token id mixes to 0; multiply by an odd constant; xor in the high half
  shifted down); ``P_l`` is an odd multiplier, one per lane (the same polynomial evaluated at two
  unrelated points: for unrelated prompts, two nearly independent 64-bit values);
* so a key is a function of (namespace root, every token from the start of the prompt to the end
  of its block), chained through the prefix: equal keys mean equal prefixes barring a collision,
  and a key differs between namespaces for the same tokens (the root lanes differ);
* collisions: for unrelated prompts each lane behaves like a random 64-bit value, so two distinct
  blocks collide with probability about 2**-128; among 10**8 distinct blocks the chance of any
  collision is about (10**8)**2 / 2 * 2**-128, roughly 1.5e-23. This is not a cryptographic hash:
  a prompt crafted for it (a Thue-Morse sequence of two token ids, 2,048 tokens long, collides
  modulo 2**64 for every odd multiplier, in both lanes at once) can make two prefixes share a key.
  The simulator's store still verifies tokens and parents, so such a prompt can only distort the
  ops tools' statistics, never serve wrong KV. ``hasher="sha256"`` gives the real keys
  (``block_keys``), exactly, at about four times the cost.

Why this form: the sum over a segment does not depend on where the segment sits except through a
factor ``P**offset``, so a segment's prefix sums are computed once per batch (in bulk, with numpy)
and every block boundary of the segment, at any offset, costs one multiply-add, done for a whole
batch of requests at once. :meth:`KeyChains.iter_keys` batches requests (a few numpy calls per
batch instead of per request); :meth:`KeyChains.keys` is the same path for one request (use
``iter_keys`` in loops: a single request pays numpy's per-call costs alone).

The default hasher stays ``"sha256"``: a caller that lets a PrefixCache compute some keys itself
(``match(tokens, ns)`` without ``keys=``) must use the real keys; the audit asks for fingerprints.
"""

from __future__ import annotations

import gc
import hashlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from prefixcache.cache import block_keys

__all__ = ["KeyChains", "Walk", "paused_gc"]

_M64 = (1 << 64) - 1
_P = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)  # odd per-lane multipliers
_P_INV = tuple(pow(p, -1, 1 << 64) for p in _P)
_MIX_ADD, _MIX_MUL = np.uint64(0x632BE59BD9B4E019), np.uint64(0xFF51AFD7ED558CCD)
_S33 = np.uint64(33)
# Distinct segment tokens per batch: its arrays stay in cache (1 << 20 was ~40% slower).
_BATCH_TOKENS = 1 << 16

# Trie node: [children {segment id: node}, keys, offset in tokens, lane 1, lane 2, id] (fingerprints;
# the id serves :meth:`KeyChains.walk`, roots are -1) or [children, keys, leftover tokens short of a
# block] (sha256).
_Node = list


def _mix(tokens: np.ndarray) -> np.ndarray:
    """uint64: each token id through a bijective mix (the constant added exceeds 2**32, so no
    token id mixes to 0)."""
    x = tokens.astype(np.uint64)
    x += _MIX_ADD
    x *= _MIX_MUL
    x ^= x >> _S33
    return x


def _geometric(p: int, n: int) -> np.ndarray:
    """uint64 ``p**i mod 2**64`` for i < n (by doubling: log n numpy calls)."""
    out = np.ones(max(n, 1), dtype=np.uint64)
    k = 1
    pk = p
    while k < n:
        m = min(k, n - k)
        np.multiply(out[:m], np.uint64(pk), out=out[k : k + m])
        k += m
        pk = pk * pk & _M64
    return out[:n]


@dataclass(slots=True)
class Walk:
    """What :meth:`KeyChains.walk` returns (see there)."""

    final: list[int]  # per request: its final node's id (-1: a root, no keys)
    node: list[int]  # per new node, in creation order: its id,
    parent: list[int]  # its parent's id,
    count: list[int]  # and how many keys it adds to its parent's
    keys: list[bytes]  # the new keys, 16 bytes each, in node order (in pieces)
    dropped: list[int]  # nodes the state bound dropped


class KeyChains:
    """Block keys of ``parts`` tuples, resuming from chain states of their segment prefixes.

    ``hasher``: ``"sha256"`` (the default: exactly :func:`~prefixcache.cache.block_keys`, so the
    keys agree with those a PrefixCache computes itself for a prompt given without keys) or
    ``"fingerprint"`` (see the module docstring; about four times cheaper, batched by
    :meth:`iter_keys`; every key given to one cache must then come from :meth:`keys`,
    :meth:`iter_keys` or :meth:`token_keys`). States of the most recent ``max_states`` segment
    prefixes are kept (FIFO). The returned lists are shared with those states: do not mutate them.
    """

    def __init__(
        self,
        segments: Sequence[np.ndarray],
        block_size: int,
        max_states: int = 100_000,
        *,
        hasher: str = "sha256",
    ) -> None:
        if hasher not in ("fingerprint", "sha256"):
            raise ValueError(f"hasher must be 'fingerprint' or 'sha256', not {hasher!r}")
        self.segments = segments
        self.B = block_size
        self.max_states = max_states
        self.hasher = hasher
        self._roots: dict[bytes, _Node] = {}
        self._fifo: deque[tuple[dict[int, _Node], int]] = deque()
        self._empty = np.zeros(0, dtype=np.uint32)
        self._next_id = 0  # trie node ids (walk)
        self._dropped: list[int] | None = None  # where _batch records dropped node ids (walk)
        # Powers of the lane multipliers and of their inverses (uint64 tables per lane, and the
        # powers as Python ints too); they grow on demand.
        self._n_pw = 0
        self._grow(1 << 16)

    # ------------------------------------------------------------------ API
    def keys(self, root: bytes, parts: tuple[int, ...]) -> list[bytes]:
        """The block keys of the prompt ``concat(segments[j] for j in parts)`` under ``root``."""
        return next(self.iter_keys(((root, parts),)))

    def token_keys(self, root: bytes, tokens: np.ndarray) -> list[bytes]:
        """The block keys of a plain token array (not a segment tuple) in this instance's scheme."""
        if self.hasher == "sha256":
            return block_keys(tokens, root, self.B)
        node = self._root(root)
        n = len(tokens) // self.B * self.B
        if not n:
            return []
        if self._n_pw < n:
            self._grow(n)
        x = _mix(np.asarray(tokens[:n], dtype=np.uint32))
        vals = np.empty((n // self.B, 2), dtype="<u8")
        for lane in (0, 1):
            x2 = x * self._pw[lane][:n]
            vals[:, lane] = np.cumsum(x2)[self.B - 1 :: self.B] + np.uint64(node[3 + lane])
        return vals.view("V16").ravel().tolist()

    def iter_keys(self, requests: Iterable[tuple[bytes, tuple[int, ...]]]) -> Iterator[list[bytes]]:
        """``keys(root, parts)`` for each ``(root, parts)`` of ``requests``, in order, computed in
        batches (``requests`` is consumed lazily, a batch ahead of what was yielded)."""
        if self.hasher == "sha256":
            for root, parts in requests:
                yield self._keys_sha(root, parts)
            return
        it = iter(requests)
        while True:
            out, new, seg_list = self._batch(it)
            if not out:
                return
            if new:
                allkeys, counts = self._compute(new, seg_list)
                keys = allkeys.view("V16").ravel().tolist()  # 16-byte bytes objects
                pos = 0
                for (node, parent, _), q in zip(new, counts, strict=True):
                    if q:
                        node[1] = parent[1] + keys[pos : pos + q]
                        pos += q
                    else:
                        node[1] = parent[1]
            yield from [n[1] for n in out]

    def walk(self, requests: Iterable[tuple[bytes, tuple[int, ...]]]) -> Walk:
        """The streaming form of :meth:`iter_keys` (fingerprints only), for a process that sends
        keys to another: every request's final trie node by id, the nodes created on the way
        (id, parent id, count of new keys; the new keys packed in one buffer, 16 bytes each) and
        the ids of nodes the state bound dropped. A receiver that keeps ``keys[id]`` for live nodes
        (``keys[-1] = []``; a new node's keys are its parent's plus its own, in creation order;
        drop the dropped ids after serving the requests) serves ``keys[final]``, exactly what
        :meth:`iter_keys` gives. Instances used with ``walk`` must not also use ``iter_keys``."""
        if self.hasher != "fingerprint":
            raise ValueError("walk() streams fingerprint keys: build KeyChains with hasher='fingerprint'")
        it = iter(requests)
        w = Walk([], [], [], [], [], [])
        self._dropped = w.dropped
        try:
            while True:
                out, new, seg_list = self._batch(it)
                if not out:
                    return w
                w.final.extend([n[5] for n in out])
                if new:
                    allkeys, counts = self._compute(new, seg_list)
                    w.node.extend([n[5] for n, _, _ in new])
                    w.parent.extend([p[5] for _, p, _ in new])
                    w.count.extend(counts)
                    w.keys.append(allkeys.tobytes())
        finally:
            self._dropped = None

    # ------------------------------------------------------------------ trie
    def _root(self, root: bytes) -> _Node:
        node = self._roots.get(root)
        if node is None:
            if self.hasher == "sha256":
                node = [{}, [], self._empty]
            else:
                d = hashlib.sha256(b"keychains-root\x00" + bytes(root)).digest()
                node = [{}, [], 0, int.from_bytes(d[:8], "little"), int.from_bytes(d[8:16], "little"), -1]
            self._roots[root] = node
        return node

    def _remember(self, children: dict[int, _Node], seg: int, node: _Node) -> None:
        children[seg] = node
        fifo = self._fifo
        fifo.append((children, seg))
        if len(fifo) > self.max_states:
            d, s = fifo.popleft()
            d.pop(s, None)  # its subtree goes with it (reachable only through it)

    def _keys_sha(self, root: bytes, parts: tuple[int, ...]) -> list[bytes]:
        node = self._root(root)
        B = self.B
        for seg in parts:
            child = node[0].get(seg)
            if child is None:
                keys, tail = node[1], node[2]
                s = self.segments[seg]
                data = np.concatenate((tail, s)) if len(tail) else s
                full = len(data) // B
                if full:
                    keys = keys + block_keys(data, keys[-1] if keys else root, B, limit=full)
                    data = data[full * B :]
                child = [{}, keys, data]
                self._remember(node[0], seg, child)
            node = child
        return node[1]

    # ------------------------------------------------------------------ fingerprints
    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._n_pw)
        self._pw = [_geometric(p, n) for p in _P]
        self._inv = [_geometric(p, n) for p in _P_INV]
        self._pw_py = [t.tolist() for t in self._pw]
        self._n_pw = n

    def _batch(
        self, it: Iterator[tuple[bytes, tuple[int, ...]]]
    ) -> tuple[list[_Node], list[tuple[_Node, _Node, int]], list[int]]:
        """Walk the next requests through the trie (creating nodes for new prefixes) until the new
        segments' tokens reach the batch budget: each request's final node, the new nodes (node,
        parent, batch segment index), parents first, and the batch's distinct new segments, for
        :meth:`_compute`."""
        segments = self.segments
        out: list[_Node] = []  # each request's final node
        new: list[tuple[_Node, _Node, int]] = []  # (node, parent, batch segment index), parents first
        seg_at: dict[int, int] = {}  # segment -> its index among the batch's distinct segments
        seg_list: list[int] = []
        tokens = 0
        roots = self._roots
        fifo = self._fifo
        cap = self.max_states
        dropped = self._dropped
        next_id = self._next_id
        for root, parts in it:
            node = roots.get(root) or self._root(root)
            for seg in parts:
                children = node[0]
                child = children.get(seg)
                if child is None:
                    child = children[seg] = [{}, None, 0, 0, 0, next_id]
                    next_id += 1
                    fifo.append((children, seg))
                    if len(fifo) > cap:
                        d, s = fifo.popleft()
                        gone = d.pop(s, None)  # its subtree goes with it (reachable only through it)
                        if dropped is not None and gone is not None:
                            dropped.append(gone[5])
                    k = seg_at.get(seg)
                    if k is None:
                        k = seg_at[seg] = len(seg_list)
                        seg_list.append(seg)
                        tokens += len(segments[seg])
                    new.append((child, node, k))
                node = child
            out.append(node)
            if tokens >= _BATCH_TOKENS or len(out) >= 8192:
                break
        self._next_id = next_id
        return out, new, seg_list

    def _compute(
        self, new: list[tuple[_Node, _Node, int]], seg_list: list[int]
    ) -> tuple[np.ndarray, list[int]]:
        """Chain states of the batch's new nodes; returns their new keys, laid end to end in
        ``new`` order (uint64 [keys, 2]: the two lanes), and how many each node adds."""
        B = self.B
        segs = [self.segments[s] for s in seg_list]
        lens = np.fromiter(map(len, segs), dtype=np.int64, count=len(segs))
        starts = np.zeros(len(segs), dtype=np.int64)
        np.cumsum(lens[:-1], out=starts[1:])
        T = int(lens.sum())
        if self._n_pw < T + 1:
            self._grow(T + 1)
        toks = np.concatenate(segs) if len(segs) > 1 else segs[0]
        # Per lane, prefix sums over the batch's distinct segments laid end to end (G[0] = 0):
        # segment k's first j tokens sum to (G[start + j] - G[start]) * P**-start.
        G = [np.zeros(T + 1, dtype=np.uint64), np.zeros(T + 1, dtype=np.uint64)]
        if T:
            x = _mix(toks)
            v = np.empty_like(x)
            for lane in (0, 1):
                np.multiply(x, self._pw[lane][:T], out=v)
                np.cumsum(v, out=G[lane][1:])
        ends = starts + lens
        tot1 = ((G[0][ends] - G[0][starts]) * self._inv[0][starts]).tolist()
        tot2 = ((G[1][ends] - G[1][starts]) * self._inv[1][starts]).tolist()
        starts_l = starts.tolist()
        lens_l = lens.tolist()
        M = _M64
        # Chain states of the new nodes (Python ints: a parent may be new in this batch too), and
        # their block boundaries: rows of G, with the offset and state that turn a row into a key.
        row0: list[int] = []
        cnt: list[int] = []
        base: list[int] = []
        offs: list[int] = []
        h1s: list[int] = []
        h2s: list[int] = []
        qs: list[int] = []
        for node, parent, k in new:
            n = lens_l[k]
            o, h1, h2 = parent[2], parent[3], parent[4]
            if o >= self._n_pw:
                self._grow(o + 1)
            p1, p2 = self._pw_py
            node[2] = o + n
            node[3] = (h1 + p1[o] * tot1[k]) & M
            node[4] = (h2 + p2[o] * tot2[k]) & M
            j = B - o % B  # first boundary inside the segment (1..B tokens in)
            if n >= j:
                st = starts_l[k]
                q = (n - j) // B + 1
                row0.append(st + j)
                cnt.append(q)
                base.append(st)
                offs.append(o)
                h1s.append(h1)
                h2s.append(h2)
                qs.append(q)
            else:
                qs.append(0)
        if cnt:
            c = np.array(cnt, dtype=np.int64)
            total = int(c.sum())
            first = np.zeros(len(cnt), dtype=np.int64)
            np.cumsum(c[:-1], out=first[1:])
            starts = np.array(row0, dtype=np.int64) - B * first
            rows = np.arange(total, dtype=np.int64) * B + np.repeat(starts, c)
            o_arr = np.array(offs, dtype=np.int64)
            b_arr = np.array(base, dtype=np.int64)
            vals = np.empty((total, 2), dtype="<u8")
            for lane, hs in ((0, h1s), (1, h2s)):
                g = G[lane]
                m = self._pw[lane][o_arr] * self._inv[lane][b_arr]  # P**(o - start)
                ad = np.array(hs, dtype=np.uint64) - g[b_arr] * m  # key = G[row] * m + ad
                x = g[rows]
                x *= np.repeat(m, c)
                x += np.repeat(ad, c)
                vals[:, lane] = x
        else:
            vals = np.empty((0, 2), dtype="<u8")
        return vals, qs


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
