"""Tier entries encrypted at rest (``serve --tier-encrypt``): ChaCha20-Poly1305 around the
codec's entry, keyed from the salt secret.

An entry of :class:`~prefixcache.cache.tiers.codec.TensorCodec` holds the block's token ids and
KV in clear (authenticated by its MAC, not hidden): whoever can read the shared Redis or the
disk tier reads every tenant's prompts. Sealed, an entry is::

    b"PXKE" | nonce (12 random bytes) | ChaCha20-Poly1305(entry, associated data b"PXKE")

with a 32-byte key derived from the salt secret by HKDF-SHA256 under its own label (so it is
neither the MAC key nor a tenant salt). Replicas sharing the secret read each other's sealed
entries; an altered one fails its tag and is a ``corrupt`` miss like any other. The AEAD comes
from the ``cryptography`` package (``pip install prefixcache[encrypt]``).
"""

from __future__ import annotations

import hashlib
import hmac
import os

SEALED_MAGIC = b"PXKE"
_NONCE = 12
_KDF_SALT = b"prefixcache tier entries"
_KDF_INFO = b"entry encryption key v1"


def derive_sealing_key(secret: str | bytes) -> bytes:
    """The 32-byte encryption key of tier entries (HKDF-SHA256 of the salt secret, own label)."""
    ikm = secret.encode() if isinstance(secret, str) else bytes(secret)
    prk = hmac.new(_KDF_SALT, ikm, hashlib.sha256).digest()
    return hmac.new(prk, _KDF_INFO + b"\x01", hashlib.sha256).digest()


class Sealer:
    """Seals and opens entries with one key. Thread-safe."""

    def __init__(self, key: bytes) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        except ImportError as e:  # pragma: no cover - the extra is installed where it is used
            raise ValueError(
                "--tier-encrypt needs the 'cryptography' package: pip install 'prefixcache[encrypt]'"
            ) from e
        self._aead = ChaCha20Poly1305(key)

    def seal(self, entry: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return SEALED_MAGIC + nonce + self._aead.encrypt(nonce, entry, SEALED_MAGIC)

    def open(self, data: bytes | bytearray | memoryview) -> bytes | None:
        """The entry inside ``data``, or None when it fails its tag (altered, or another key)."""
        from cryptography.exceptions import InvalidTag

        mv = memoryview(data)
        if len(mv) < len(SEALED_MAGIC) + _NONCE + 16:
            return None
        nonce = bytes(mv[len(SEALED_MAGIC) : len(SEALED_MAGIC) + _NONCE])
        try:
            return self._aead.decrypt(nonce, bytes(mv[len(SEALED_MAGIC) + _NONCE :]), SEALED_MAGIC)
        except InvalidTag:
            return None
