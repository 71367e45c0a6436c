"""Inputs that used to cost CPU or crash after the prefill: a tiny temperature samples greedily
(not NaN), text that cannot fit the context is refused before the tokenizer sees it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prefixcache.engine import PromptTooLongError
from prefixcache.engine.engine import Engine
from prefixcache.engine.prompts import max_token_bytes
from prefixcache.engine.serving.sampling import GREEDY_BELOW, Sampler, SamplingParams


def test_a_temperature_that_overflows_the_logits_is_greedy() -> None:
    logits = torch.tensor([1.0, 30.0, -5.0, 29.5])
    for t in (1e-40, 5e-324, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=t, seed=1).validate()
        assert params.greedy
        assert Sampler(params)(logits) == 1
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy  # the floor itself samples


def test_tiny_temperature_through_the_engine_equals_greedy(tiny_engine: Engine) -> None:
    tiny = tiny_engine.generate(prompt="the same answer", max_tokens=6, temperature=1e-40, seed=3)
    greedy = tiny_engine.generate(prompt="the same answer", max_tokens=6, temperature=0.0)
    assert tiny.tokens == greedy.tokens


class _CountingTokenizer:
    """The tiny engine's tokenizer, counting the characters it was asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded_chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded_chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_text_over_the_context_bound_is_refused_without_tokenizing(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _CountingTokenizer(tiny_engine.runner.tokenizer)
    monkeypatch.setattr(tiny_engine.runner, "tokenizer", counting)
    limit = tiny_engine.max_prompt_bytes
    assert limit == tiny_engine.context_len * 12  # the byte tokenizer's longest token: "<|im_start|>"
    for text in ("x" * (limit + 1), "\u00e9" * (limit // 2 + 1)):  # ASCII, and 2 bytes a character
        with pytest.raises(PromptTooLongError, match="context"):
            tiny_engine.tokenize(text)
        with pytest.raises(PromptTooLongError):
            tiny_engine.generate(messages=[{"role": "user", "content": text}], max_tokens=1)
    assert counting.encoded_chars == 0
    # Under the bound the tokenizer decides (and the context check counts tokens as before).
    with pytest.raises(PromptTooLongError, match="tokens"):
        tiny_engine.generate(prompt="x" * (limit // 12), max_tokens=1)
    assert counting.encoded_chars == limit // 12


def test_max_token_bytes_of_a_byte_level_vocabulary() -> None:
    class ByteLevelish:
        class backend_tokenizer:  # noqa: N801 - the attribute names of a HF tokenizer
            decoder = "ByteLevel(add_prefix_space=True)"

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "\u0120the": 1, "<|im_start|>": 2, "\u00e9\u00e9": 3}

        def get_added_vocab(self) -> dict[str, int]:
            return {"<|im_start|>": 2, "\u00e9\u00e9": 3}

    assert max_token_bytes(ByteLevelish()) == 12  # "Ġthe" is 4 bytes; the added "éé" is 4 UTF-8 bytes
    assert max_token_bytes(object()) is None


def test_a_lone_surrogate_is_a_clear_error_not_a_tokenizer_crash(tiny_engine: Engine) -> None:
    from prefixcache.engine import InvalidRequestError

    with pytest.raises(TypeError):  # what Hugging Face's fast tokenizers do, and the tiny one too
        tiny_engine.tokenizer.encode("a\ud800b")
    for call in (
        lambda: tiny_engine.tokenize("a\ud800b"),
        lambda: tiny_engine.generate(messages=[{"role": "user", "content": "\udfff"}], max_tokens=1),
        lambda: tiny_engine.count_tokens(prompt="x\ud83d"),
    ):
        with pytest.raises(InvalidRequestError, match="surrogate"):
            call()
    assert tiny_engine.tokenize("\U0001f642") == list("\U0001f642".encode())  # a valid pair is text
