"""A compact, authenticated binary entry for one cached block (no pickle).

Layout (little-endian)::

    header   struct "<4sBBBBHHIQ": magic b"PXKV", version, dtype code, ndim, flags,
             key length, parent length, token-bytes length, payload length
    key      key length bytes (the block's chained SHA-256)
    parent   parent length bytes (0 for a prompt's first block; flags bit 0 set)
    tokens   packed uint32 token ids of the block (see ``cache.keys.pack_tokens``)
    shape    ndim x uint64
    payload  the tensor's raw bytes, C order, in its own dtype
    mac      keyed BLAKE2b-256 over everything above

The MAC key is derived from the server's salt secret (:func:`derive_tier_key`, HKDF-SHA256 with
a label of its own) and never written anywhere: whoever can write to Redis or to the disk tier
but does not hold the secret cannot make an entry that verifies, even with every byte of a
genuine one in hand. Replicas of one deployment share the salt secret, hence the key, and read
each other's entries.

:func:`TensorCodec.decode` checks, before any tensor is built: magic, version, lengths, the
shape and dtype against the model's :class:`BlockLayout` (when given), the MAC, then the
caller's expectations (key, parent, tokens). Any mismatch raises :class:`CorruptEntry` and the
tier counts a miss (``corrupt``), deletes the entry and never serves it. The decoded tensor is
bit-identical to the encoded one, which is what keeps a tier hit exact.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.tiers.sealed import SEALED_MAGIC, Sealer, derive_sealing_key

MAGIC = b"PXKV"
VERSION = 2  # 1: an unkeyed checksum (no longer accepted)
_HEADER = struct.Struct("<4sBBBBHHIQ")
_MAC_SIZE = 32
_NO_PARENT = 0x01
_MAC_PERSON = b"pxc-entry-mac"  # BLAKE2b personalisation: one key, separate uses
_NAMESPACE_PERSON = b"pxc-namespace"
_KDF_SALT = b"prefixcache tier entries"
_KDF_INFO = b"entry MAC key v2"

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
_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
}


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


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What one block's payload must be for the engine that reads it: the KV pool's per-block
    ``shape`` (``[layers, 2, kv_heads, B, head_dim]``) and ``dtype`` (a torch dtype name)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(_DTYPE_CODES)}")


def derive_tier_key(secret: str | bytes) -> bytes:
    """The 32-byte MAC key of tier entries from the server's salt secret: HKDF-SHA256 (RFC 5869)
    with its own salt and info labels, so it equals no tenant salt (``HMAC(secret, tenant)``)."""
    ikm = secret.encode() if isinstance(secret, str) else bytes(secret)
    prk = hmac.new(_KDF_SALT, ikm, hashlib.sha256).digest()  # extract
    return hmac.new(prk, _KDF_INFO + b"\x01", hashlib.sha256).digest()  # expand, one block


#: The key of a process that was given no secret: its entries verify in this process only.
_PROCESS_KEY = derive_tier_key(secrets.token_bytes(32))


@dataclass(frozen=True, slots=True)
class TensorCodec:
    """Encodes a block whose payload is one torch tensor (the engine's KV block).

    ``key``: the MAC key (:func:`derive_tier_key`; :meth:`from_secret` derives it). Default: a
    random key of this process, so entries verify only within it. Immutable and thread-safe.
    ``encode`` copies the tensor to CPU if needed; ``decode`` returns an owned, writable CPU tensor.
    """

    key: bytes = field(default=_PROCESS_KEY, repr=False)
    #: encrypts every entry written (:mod:`~prefixcache.cache.tiers.sealed`); None: clear text.
    #: Either way, sealed entries are opened on read and clear ones still verify by their MAC.
    sealer: Sealer | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_secret(cls, secret: str | bytes | None, *, encrypt: bool = False) -> TensorCodec:
        """A codec keyed from the salt secret (None: this process's random key); ``encrypt``:
        seal entries with a key derived from the same secret (ValueError without one)."""
        if encrypt:
            if secret is None:
                raise ValueError(
                    "--tier-encrypt needs a salt secret shared by the replicas (--salt-secret-file)"
                )
            return cls(derive_tier_key(secret), Sealer(derive_sealing_key(secret)))
        return cls() if secret is None else cls(derive_tier_key(secret))

    def namespace_tag(self, root: bytes) -> str:
        """A keyed 32-hex-digit name for a namespace root: what the tiers index a tenant's entries
        under (the root itself, which lets one test guessed prompts, is never stored)."""
        return hashlib.blake2b(root, digest_size=16, key=self.key, person=_NAMESPACE_PERSON).hexdigest()

    def _mac(self, data: bytes | memoryview) -> bytes:
        return hashlib.blake2b(data, digest_size=_MAC_SIZE, key=self.key, person=_MAC_PERSON).digest()

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
        entry = body + self._mac(body)
        return self.sealer.seal(entry) if self.sealer is not None else entry

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        key: bytes | None = None,
        parent: bytes | None | bool = False,
        tokens: bytes | None = None,
        layout: BlockLayout | None = None,
    ) -> Entry:
        """Verify and deserialize. ``key``/``tokens`` when given must match exactly; ``parent``
        (``False``: not checked; ``None``: must be a first block) likewise; ``layout``, when
        given, is the only shape and dtype accepted. Raises CorruptEntry, before building any
        tensor."""
        import torch

        mv = memoryview(data)
        if bytes(mv[: len(SEALED_MAGIC)]) == SEALED_MAGIC:
            opened = self.sealer.open(mv) if self.sealer is not None else None
            if opened is None:
                raise CorruptEntry("sealed entry that does not open (altered, or another secret)")
            mv = memoryview(opened)
        if len(mv) < _HEADER.size + _MAC_SIZE:
            raise CorruptEntry("entry too short")
        magic, version, code, ndim, flags, klen, plen, tlen, nraw = _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise CorruptEntry("bad magic")
        if version != VERSION:
            raise CorruptEntry(f"unsupported entry version {version}")
        total = _HEADER.size + klen + plen + tlen + 8 * ndim + nraw
        if len(mv) != total + _MAC_SIZE:
            raise CorruptEntry(f"length {len(mv)} != {total + _MAC_SIZE}")
        dtype_name = _CODE_DTYPES.get(code)
        if dtype_name is None:
            raise CorruptEntry(f"unknown dtype code {code}")
        off = _HEADER.size + klen + plen + tlen
        shape = struct.unpack_from(f"<{ndim}Q", mv, off)
        if layout is not None and (shape != layout.shape or dtype_name != layout.dtype):
            raise CorruptEntry(
                f"layout {dtype_name}{list(shape)} is not the model's block layout "
                f"{layout.dtype}{list(layout.shape)}"
            )
        n = 1
        for d in shape:
            n *= d
        if n * _ITEMSIZE[dtype_name] != nraw:
            raise CorruptEntry("payload size does not match shape and dtype")
        if not hmac.compare_digest(self._mac(mv[:total]), bytes(mv[total:])):
            raise CorruptEntry("MAC mismatch (altered, or written without this deployment's secret)")
        off = _HEADER.size
        key_b = bytes(mv[off : off + klen])
        off += klen
        parent_b: bytes | None = None if flags & _NO_PARENT else bytes(mv[off : off + plen])
        off += plen
        tok_b = bytes(mv[off : off + tlen])
        off += tlen + 8 * ndim
        if key is not None and key_b != key:
            raise CorruptEntry("key mismatch")
        if parent is not False and parent_b != parent:
            raise CorruptEntry("parent mismatch")
        if tokens is not None and tok_b != tokens:
            raise CorruptEntry("token mismatch")
        dtype = getattr(torch, dtype_name)
        buf = bytearray(mv[off : off + nraw])  # owned and writable: the tensor keeps it alive
        tensor = (
            torch.frombuffer(buf, dtype=dtype, count=n).reshape(shape)
            if n
            else torch.empty(shape, dtype=dtype)
        )
        return Entry(key=key_b, parent=parent_b, tokens=tok_b, payload=tensor, nbytes=nraw)
