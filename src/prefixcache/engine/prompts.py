"""Chat rendering: OpenAI/Anthropic-shaped messages -> the model's chat template -> token ids.

    text = render_chat(messages, tokenizer)                   # add_generation_prompt=True
    ids = render_ids(messages, tokenizer)
    ends = breakpoint_token_ends(messages, [(0, None), (2, 1)], tokenizer)

``content`` may be a string or a list of content blocks (``{"type": "text", "text": ...}``);
blocks are joined without separator. A breakpoint ``(message_index, block_index)`` names the end
of one content block (``block_index`` None: the end of the message's whole content), and
:func:`breakpoint_token_ends` says after how many prompt tokens that point lies, which is what
Anthropic ``cache_control`` breakpoints need.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from prefixcache.content import content_text
from prefixcache.engine.serving.sampling import InvalidRequestError

Message = dict[str, Any]


class EmptyPromptError(InvalidRequestError):
    """No prompt, no messages, or nothing in them."""


class PromptTooLongError(InvalidRequestError):
    """prompt tokens + max_tokens exceed the model's context."""


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """``[{"role", "content": str}]``; raises :class:`EmptyPromptError` / InvalidRequestError."""
    if not messages:
        raise EmptyPromptError(
            "messages is empty: pass at least one {'role': 'user', 'content': ...} message"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError(
                f"messages[{i}] must be a dict with 'role' and 'content'; got {m!r:.80}"
            )
        out.append({"role": str(m["role"]), "content": content_text(m.get("content"))})
    return out


@functools.lru_cache(maxsize=1)
def _default_tokenizer() -> Any:
    from prefixcache.engine.model import load_tokenizer

    return load_tokenizer()


def render_chat(
    messages: Sequence[Message], tokenizer: Any = None, *, add_generation_prompt: bool = True
) -> str:
    """The prompt text the model sees for these messages (default: the embedded model's template)."""
    tok = tokenizer if tokenizer is not None else _default_tokenizer()
    flat = normalize_messages(messages)
    if getattr(tok, "chat_template", None):
        return str(tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=add_generation_prompt))
    # A model without a template: a plain, unambiguous layout.
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in flat)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``; special-token strings in it (from the template) become specials."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of text that one token stands for (None: unknown).

    A tokenizer may declare it (``max_token_bytes``); otherwise it is read off the vocabulary.
    Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM, Qwen) spell each byte as one character,
    so a token's length in characters is its length in bytes; any other vocabulary (SentencePiece's
    "\u2581" for a space, ``<0x0A>`` byte tokens) is counted by its UTF-8 length, which can only
    over-count. Added tokens (the template's specials) count by their UTF-8 length. A tokenizer
    whose normalizer deletes text (accent stripping) could beat the bound; causal LM tokenizers
    do not normalize that way.
    """
    declared = getattr(tokenizer, "max_token_bytes", None)
    if isinstance(declared, int) and declared > 0:
        return declared
    try:
        vocab = tokenizer.get_vocab()
        added = dict(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else {}
    except Exception:  # a tokenizer without a readable vocabulary: no bound
        return None
    if not vocab:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))

    def size(token: str) -> int:
        if byte_level and token not in added:
            return len(token)
        return len(token.encode("utf-8", "surrogatepass"))

    return max(size(t) for t in vocab)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_prompt_text(text: str, max_bytes: int | None, context_len: int) -> None:
    """Refuse, before any tokenizing, text that is not text (a lone UTF-16 surrogate, such as
    ``\ud800`` without its pair: tokenizers raise TypeError on it) or that has more tokens than
    ``context_len`` whatever the tokenizer does (over ``max_bytes`` UTF-8 bytes: see
    :func:`max_token_bytes`)."""
    if _SURROGATE.search(text):  # Python joins valid pairs: any surrogate left is lone
        raise InvalidRequestError(
            "the prompt holds a lone UTF-16 surrogate (such as \\ud800 without its "
            "pair), which is not text; send valid Unicode"
        )
    if max_bytes is not None and over_bytes(text, max_bytes):
        raise PromptTooLongError(
            f"the prompt is over {max_bytes} bytes of text, more than the model's "
            f"context of {context_len} tokens can hold; shorten the prompt"
        )


def over_bytes(text: str, limit: int) -> bool:
    """Whether ``text`` is over ``limit`` UTF-8 bytes. Its length in characters is at most its
    bytes and at least a quarter of them, so it is encoded only when the length does not decide."""
    if len(text) > limit or len(text) * 4 <= limit:
        return len(text) > limit
    return len(text.encode("utf-8", "surrogatepass")) > limit


def render_ids(
    messages: Sequence[Message], tokenizer: Any = None, *, add_generation_prompt: bool = True
) -> list[int]:
    tok = tokenizer if tokenizer is not None else _default_tokenizer()
    return encode(tok, render_chat(messages, tok, add_generation_prompt=add_generation_prompt))


def breakpoint_token_ends(
    messages: Sequence[Message],
    breakpoints: Sequence[tuple[int, int | None]],
    tokenizer: Any = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """For each ``(message_index, block_index)``, the number of leading prompt tokens that end at
    (or just before) the end of that content block in the full rendered prompt. When the block
    is its message's last, the template's closing tag of the message is included (it is the same
    in every later prompt, so it can be cached with it).

    Method: render the conversation cut after the breakpoint, keep the part of its text shared
    with the full prompt's text (the template's closing tags differ), tokenize that, and count
    the leading tokens equal to the full prompt's: a token straddling the cut is not counted,
    so the result is always a true token prefix of the full prompt.
    """
    tok = tokenizer if tokenizer is not None else _default_tokenizer()
    full_text = render_chat(messages, tok, add_generation_prompt=add_generation_prompt)
    full_ids = encode(tok, full_text)
    ends = []
    for mi, bi in breakpoints:
        if not 0 <= mi < len(messages):
            raise InvalidRequestError(f"breakpoint message index {mi} is outside 0..{len(messages) - 1}")
        cut = [dict(m) for m in messages[: mi + 1]]
        cut[-1]["content"] = content_text(messages[mi].get("content"), bi)
        cut_text = render_chat(cut, tok, add_generation_prompt=False)
        common = 0
        for a, b in zip(cut_text, full_text, strict=False):
            if a != b:
                break
            common += 1
        cut_ids = encode(tok, cut_text[:common])
        n = 0
        for cut_id, full_id in zip(cut_ids, full_ids, strict=False):
            if cut_id != full_id:
                break
            n += 1
        # The last shared id may be a longer token in the full prompt that only starts here.
        if n and n == len(cut_ids) and len(tok.decode(full_ids[:n])) > common:
            n -= 1
        ends.append(n)
    return ends


def chat_template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list (Hugging Face's tool-use
    convention: ``apply_chat_template(messages, tools=[...])``). A dict of named templates
    counts when it has a ``tool_use`` one or any template that mentions ``tools``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return "tools" in template
    if isinstance(template, dict):
        return "tool_use" in template or any(isinstance(t, str) and "tools" in t for t in template.values())
    return False


def render_chat_with_tools(
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]],
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a tool-using conversation by the model's own chat template.

    ``messages`` are in Hugging Face's tool-use shape and passed through unflattened: assistant
    turns may carry ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``)
    and ``role: "tool"`` turns carry a tool's result. ``tools`` are OpenAI-style function
    definitions (``{"type": "function", "function": {...}}``). Call only when
    :func:`chat_template_supports_tools` is true; the template's own errors propagate.
    """
    text = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return str(text)


class PromptReader:
    """The prompt side of an engine (a base of :class:`~prefixcache.engine.engine.Engine`): text
    and chat messages to token ids, checked against the runner's context and vocabulary."""

    runner: Any  # a ModelRunner: its tokenizer, context_len and vocab_size

    @functools.cached_property
    def max_prompt_bytes(self) -> int | None:
        """Text longer than this (UTF-8 bytes) has more tokens than the context holds: the
        context times the most bytes one token stands for (None: the tokenizer does not say)."""
        per_token = max_token_bytes(self.runner.tokenizer)
        return None if per_token is None else self.runner.context_len * per_token

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``. Text that cannot fit the context (over :attr:`max_prompt_bytes`)
        raises :class:`PromptTooLongError` before any tokenizing: a 60 MB prompt costs no CPU; a
        lone surrogate raises :class:`InvalidRequestError`."""
        check_prompt_text(text, self.max_prompt_bytes, self.runner.context_len)
        return encode(self.runner.tokenizer, text)

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        return render_chat(messages, self.runner.tokenizer, add_generation_prompt=add_generation_prompt)

    def render_ids(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.tokenize(self.render(messages, add_generation_prompt=add_generation_prompt))

    def prompt_ids(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | Sequence[int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """The token ids a request would prefill. Exactly one source must be given."""
        given = [x is not None for x in (messages, prompt, prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("pass exactly one of messages=, prompt= or prompt_token_ids=")
        if messages is not None:
            ids = self.render_ids(messages)
        elif isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = [int(t) for t in (prompt if prompt is not None else prompt_token_ids or [])]
        if not ids:
            raise EmptyPromptError("the prompt is empty: pass a non-empty prompt or messages with content")
        vocab = self.runner.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def count_tokens(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | Sequence[int] | None = None,
    ) -> int:
        return len(self.prompt_ids(messages, prompt))
