"""Structured output: a grammar mask on each row's logits, through llguidance.

    grammars = Grammars(tokenizer, vocab_size, eos_ids)     # one per engine
    grammar = grammars.compile("json_schema", schema)        # compiled once per schema (cached)
    engine.generate(prompt=..., grammar=grammar)             # every choice decodes inside it

The mask is applied per row *after* the step computed the logits, on a copy the sampler draws
from: the logits themselves (and so the reported logprobs, and everything the cache stores) are
bitwise what they are without a grammar. A token the grammar forbids gets -inf; when the grammar
is complete and allows nothing more, the choice ends (finish_reason "stop"); ``max_tokens`` still
bounds it ("length": then the text may be incomplete). Kinds: ``json_schema`` (JSON Schema, as
llguidance supports it), ``json`` (any JSON object), ``regex``, ``lark`` (a Lark or GBNF grammar),
``choice`` (one of a list of strings).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from prefixcache.engine.serving.sampling import InvalidRequestError

KINDS = ("json_schema", "json", "regex", "lark", "choice")
#: JSON without free whitespace (a schema's own ``x-guidance`` may change it): a small model
#: cannot spend its tokens on blank lines, and the answer is what ``json.dumps`` would write.
COMPACT: Any = {"whitespace_flexible": False}
#: Compiled grammars kept per engine (the least recently used goes first).
MAX_CACHED = 256


class Grammar:
    """One compiled grammar: :meth:`matcher` starts a fresh state for one choice."""

    def __init__(self, tokenizer: Any, text: str, vocab_size: int) -> None:
        import llguidance

        self._tokenizer = tokenizer
        self._text = text
        self.vocab_size = vocab_size
        probe = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if probe.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {probe.get_error()[:300]}")
        self._template = probe

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.vocab_size)


class Matcher:
    """One choice's position in its grammar."""

    __slots__ = ("m", "vocab_size")

    def __init__(self, m: Any, vocab_size: int) -> None:
        self.m = m
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` with every token the grammar forbids now at -inf."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.numel()].astype(np.bool_))
        if not bool(allowed.any()):  # an error state: let the choice end on EOS only
            return logits.clone()
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        self.m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """Nothing more may follow (the grammar is complete and stops, or an error state)."""
        return bool(self.m.is_stopped() or self.m.is_error())


class Grammars:
    """The engine's grammar compiler: the model's tokenizer as llguidance sees it, and a cache of
    compiled grammars keyed by (kind, canonical spec)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self.compiled = 0  # grammars compiled (cache misses), for tests and metrics

    def _tokenizer(self) -> Any:
        if self._ll is None:
            self._ll = _ll_tokenizer(self._hf, self.vocab_size, self.eos_ids)
        return self._ll

    def compile(self, kind: str, spec: Any) -> Grammar:
        """The compiled grammar for ``spec`` (a JSON Schema dict, a regex or Lark string, a list
        of strings for ``choice``, None for ``json``). Raises InvalidRequestError."""
        if kind not in KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {', '.join(KINDS)}; got {kind!r}")
        key = (kind, json.dumps(spec, sort_keys=True, separators=(",", ":")))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            grammar = Grammar(self._tokenizer(), _grammar_text(kind, spec), self.vocab_size)
            self.compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return grammar


def _grammar_text(kind: str, spec: Any) -> str:
    import llguidance

    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
        if kind == "json_schema":
            if not isinstance(spec, dict):
                raise InvalidRequestError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=COMPACT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(spec))
        if kind == "lark":
            return llguidance.grammar_from("grammar", str(spec))
        if not isinstance(spec, list) or not spec or not all(isinstance(s, str) for s in spec):
            raise InvalidRequestError("a choice grammar is a non-empty list of strings")
        return llguidance.grammar_from("choice", json.dumps(spec))
    except ValueError as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"the {kind} cannot be compiled: {str(exc)[:300]}") from exc


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> Any:
    """llguidance's view of the model's tokenizer: a Hugging Face fast tokenizer directly, else
    each id's bytes (specials marked as llguidance expects: a 0xFF prefix)."""
    import llguidance

    if hasattr(tokenizer, "backend_tokenizer"):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids[0])
    from prefixcache.engine.serving.detok import TokenText

    text = TokenText(tokenizer)
    specials = set(getattr(tokenizer, "all_special_ids", None) or []) | set(eos_ids)
    names = getattr(tokenizer, "_names", {})
    specials |= set(names)
    tokens = []
    for i in range(vocab_size):
        raw = text.bytes(i) if i < len(tokenizer) else b""
        tokens.append(b"\xff" + raw if i in specials else raw)

    class _Wrapped:
        eos_token_id = eos_ids[0]
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special_token_ids = sorted(specials)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, data: bytes) -> list[int]:
            return list(tokenizer.encode(data.decode("utf-8", errors="replace")))

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), n_vocab=vocab_size)


__all__ = ["KINDS", "Grammar", "Grammars", "Matcher"]
