"""A tiny randomly initialised Llama and a byte-level chat tokenizer: fast tests, no download.

    runner = ModelRunner.tiny(seed=0)          # or tiny_llama(seed=0) -> (model, tokenizer)

The tokenizer maps UTF-8 bytes to ids 0..255 and has four special tokens; its chat template is
ChatML (the same shape as SmolLM2's), so the engine's rendering code path is the real one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

PAD, BOS, EOS, IM_START = 256, 257, 258, 259
SPECIALS = {"<pad>": PAD, "<s>": BOS, "<|im_end|>": EOS, "<|im_start|>": IM_START}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


class ByteChatTokenizer:
    """Byte-level tokenizer with the slice of the Hugging Face tokenizer API the engine uses:
    ``encode``, ``decode``, ``apply_chat_template``, ``eos_token_id``, ``chat_template``."""

    chat_template = "chatml"  # marker only: rendering is done in code below
    eos_token = "<|im_end|>"
    eos_token_id = EOS
    bos_token_id = BOS
    pad_token_id = PAD
    #: The longest text one token stands for: a special token's name (a byte token is 1 byte).
    max_token_bytes = max(len(name) for name in SPECIALS)

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 260:
            raise ValueError(f"the byte tokenizer needs vocab_size >= 260; got {vocab_size}")
        self.vocab_size = vocab_size
        self._names = {v: k for k, v in SPECIALS.items()}

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Bytes of ``text``; the special token strings become their ids. A lone surrogate raises
        TypeError, as Hugging Face's fast tokenizers do (tests then see what the real one does)."""
        if _SURROGATE_RE.search(text):
            raise TypeError(
                "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"
            )
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if part in SPECIALS:
                ids.append(SPECIALS[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Bytes back to text; incomplete UTF-8 sequences become U+FFFD (like HF tokenizers)."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special_tokens and i in self._names:
                out.append(self._names[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (a special token: its name), for logprobs."""
        return bytes([token_id]) if token_id < 256 else self._names.get(token_id, "").encode()

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **_: Any,
    ) -> str | list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


def tiny_llama(
    seed: int = 0,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    context: int = 2048,
) -> tuple[Any, ByteChatTokenizer]:
    """A randomly initialised ``LlamaForCausalLM`` (float32, eval mode) and its tokenizer.

    Deterministic in ``seed``. Weights are scaled up from the HF init so that greedy decoding
    does not collapse to one token, which makes text comparisons in tests meaningful.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        attn_implementation="sdpa",  # type: ignore[call-arg]  # (a PretrainedConfig kwarg the stubs omit)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.25)
    model.eval()
    return model, ByteChatTokenizer(vocab)
