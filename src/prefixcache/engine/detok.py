"""Incremental detokenization with stop strings, for streaming.

Tokens can end in the middle of a UTF-8 character (byte-fallback tokens): a delta is released
only when the decoded text no longer ends in U+FFFD. Text that could be the start of a stop
string is held back until it is known not to be one, so a stream never shows a stop string or
anything after it, and the concatenated deltas always equal the final text.
"""

from __future__ import annotations

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
