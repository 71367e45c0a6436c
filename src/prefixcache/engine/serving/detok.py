"""Incremental detokenization with stop strings, for streaming.

Tokens can end in the middle of a UTF-8 character (byte-fallback tokens): a delta is released
only when the decoded text no longer ends in U+FFFD. Text that could be the start of a stop
string is held back until it is known not to be one, so a stream never shows a stop string or
anything after it, and the concatenated deltas always equal the final text.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any


class TextAssembler:
    """Feed token ids with :meth:`push`; read deltas; :meth:`finish` flushes the rest."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] | None = None) -> None:
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already appended (a context window)
        self._read = 0
        self.text = ""  # decoded so far (may run past a stop string until checked)
        self.emitted = 0  # chars of self.text already handed out
        self.stop_sequence: str | None = None

    def _decode_new(self) -> str:
        before = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that may be shown now (maybe "").
        After a stop string is found, :attr:`stop_sequence` is set and the caller stops."""
        self.ids.append(int(token_id))
        self.text += self._decode_new()
        if self.stop:
            start = max(0, self.emitted - self._hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                idx, s = min(hits)
                self.stop_sequence = s
                self.text = self.text[:idx]
                return self._emit(len(self.text))
            return self._emit(len(self.text) - self._hold)
        return self._emit(len(self.text))

    def finish(self) -> str:
        """The held-back remainder (including a trailing partial character, as U+FFFD)."""
        if self.stop_sequence is None and self._read < len(self.ids):
            tail = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
            before = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
            self.text += tail[len(before) :]
            self._read = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character that stands for each byte
    in a byte-level BPE vocabulary (``Ġ`` for a space) -> that byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenText:
    """A token id's own bytes and a printable string of them, for logprobs (cached per id).

    Byte-level BPE tokenizers (GPT-2 style, SmolLM2's) map their vocabulary strings back to
    bytes; byte-fallback tokens (``<0xE2>``) are that byte; a tokenizer may also offer
    ``token_bytes(id)`` (the tiny test tokenizer does); otherwise the token's decoded text.
    A token may hold part of a UTF-8 character: :meth:`text` writes such bytes as ``\\xNN``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._cache: dict[int, bytes] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None

    def bytes(self, token_id: int) -> bytes:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(int(token_id))
        return hit

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="backslashreplace")

    def _lookup(self, token_id: int) -> builtins.bytes:
        own = getattr(self.tok, "token_bytes", None)
        if own is not None:
            return bytes(own(token_id))
        piece = None
        convert = getattr(self.tok, "convert_ids_to_tokens", None)
        if convert is not None:
            piece = convert(token_id)
        if isinstance(piece, str):
            alphabet = self._alphabet
            if alphabet is not None and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
        return self.tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
