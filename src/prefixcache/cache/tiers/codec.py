"""A compact, self-verifying binary entry for one cached block (no pickle).

Layout (little-endian)::

    header   struct "<4sBBBBHHIQ": magic b"PXKV", version, dtype code, ndim, flags,
             key length, parent length, token-bytes length, payload length
    key      key length bytes (the block's chained SHA-256)
    parent   parent length bytes (0 for a prompt's first block; flags bit 0 set)
    tokens   packed uint32 token ids of the block (see ``cache.keys.pack_tokens``)
    shape    ndim x uint64
    payload  the tensor's raw bytes, C order, in its own dtype
    digest   blake2b-256 over everything above

:func:`decode` checks magic, version, lengths and the digest, then the caller's expectations
(key, parent, tokens); any mismatch raises :class:`CorruptEntry` and the tier counts a miss.
The decoded tensor is bit-identical to the encoded one, which is what keeps a tier hit exact.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"PXKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBHHIQ")
_DIGEST_SIZE = 32
_NO_PARENT = 0x01

# dtype name <-> stable one-byte code (never renumber: persisted entries carry the code).
_DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "uint8": 5,
    "int8": 6,
    "int32": 7,
    "int64": 8,
}
_CODE_DTYPES = {code: name for name, code in _DTYPE_CODES.items()}


class CorruptEntry(ValueError):
    """A stored entry failed verification: it must be treated as a miss and never served."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded, verified entry."""

    key: bytes
    parent: bytes | None
    tokens: bytes
    payload: Any  # torch.Tensor, shape ``shape``, dtype ``dtype``
    nbytes: int


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE).digest()


@dataclass(frozen=True, slots=True)
class TensorCodec:
    """Encodes a block whose payload is one torch tensor (the engine's KV block).

    Stateless and thread-safe. ``encode`` copies the tensor to CPU if needed; ``decode`` returns
    an owned, writable CPU tensor.
    """

    def encode(self, key: bytes, parent: bytes | None, tokens: bytes, payload: Any) -> bytes:
        """Serialize one block. ``payload``: a torch tensor, or an object whose ``as_tensor()``
        gives one (the engine's pool blocks). Raises TypeError otherwise."""
        import torch  # (lazily: the cache layer stays importable without torch)

        if not isinstance(payload, torch.Tensor) and callable(getattr(payload, "as_tensor", None)):
            payload = payload.as_tensor()
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"TensorCodec encodes torch tensors; got {type(payload).__name__}")
        name = str(payload.dtype).removeprefix("torch.")
        code = _DTYPE_CODES.get(name)
        if code is None:
            raise TypeError(f"unsupported dtype {payload.dtype}; supported: {sorted(_DTYPE_CODES)}")
        t = payload.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        parent_b = parent or b""
        flags = _NO_PARENT if parent is None else 0
        shape = struct.pack(f"<{t.dim()}Q", *t.shape)
        head = _HEADER.pack(
            MAGIC, VERSION, code, t.dim(), flags, len(key), len(parent_b), len(tokens), len(raw)
        )
        body = b"".join((head, key, parent_b, tokens, shape, raw))
        return body + _digest(body)

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        key: bytes | None = None,
        parent: bytes | None | bool = False,
        tokens: bytes | None = None,
    ) -> Entry:
        """Verify and deserialize. ``key``/``tokens`` when given must match exactly; ``parent``
        (``False``: not checked; ``None``: must be a first block) likewise. Raises CorruptEntry."""
        import torch

        mv = memoryview(data)
        if len(mv) < _HEADER.size + _DIGEST_SIZE:
            raise CorruptEntry("entry too short")
        magic, version, code, ndim, flags, klen, plen, tlen, nraw = _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise CorruptEntry("bad magic")
        if version != VERSION:
            raise CorruptEntry(f"unsupported entry version {version}")
        total = _HEADER.size + klen + plen + tlen + 8 * ndim + nraw
        if len(mv) != total + _DIGEST_SIZE:
            raise CorruptEntry(f"length {len(mv)} != {total + _DIGEST_SIZE}")
        if _digest(mv[:total]) != bytes(mv[total:]):
            raise CorruptEntry("checksum mismatch")
        dtype_name = _CODE_DTYPES.get(code)
        if dtype_name is None:
            raise CorruptEntry(f"unknown dtype code {code}")
        off = _HEADER.size
        key_b = bytes(mv[off : off + klen])
        off += klen
        parent_b: bytes | None = bytes(mv[off : off + plen])
        off += plen
        if flags & _NO_PARENT:
            parent_b = None
        tok_b = bytes(mv[off : off + tlen])
        off += tlen
        shape = struct.unpack_from(f"<{ndim}Q", mv, off)
        off += 8 * ndim
        if key is not None and key_b != key:
            raise CorruptEntry("key mismatch")
        if parent is not False and parent_b != parent:
            raise CorruptEntry("parent mismatch")
        if tokens is not None and tok_b != tokens:
            raise CorruptEntry("token mismatch")
        dtype = getattr(torch, dtype_name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        if n * itemsize != nraw:
            raise CorruptEntry("payload size does not match shape and dtype")
        buf = bytearray(mv[off : off + nraw])  # owned and writable: the tensor keeps it alive
        tensor = (
            torch.frombuffer(buf, dtype=dtype, count=n).reshape(shape)
            if n
            else torch.empty(shape, dtype=dtype)
        )
        return Entry(key=key_b, parent=parent_b, tokens=tok_b, payload=tensor, nbytes=nraw)
