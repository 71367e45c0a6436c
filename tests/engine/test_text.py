"""Incremental detokenization, stop strings, chat rendering and breakpoints (no model compute)."""

from __future__ import annotations

from prefixcache.engine.prompts import breakpoint_token_ends, render_chat, render_ids
from prefixcache.engine.serving.detok import TextAssembler
from prefixcache.engine.tiny import EOS, ByteChatTokenizer

TOK = ByteChatTokenizer()


def _stream(text: str, stop: list[str] | None = None) -> tuple[list[str], TextAssembler]:
    asm = TextAssembler(TOK, stop)
    deltas = []
    for b in text.encode("utf-8"):
        deltas.append(asm.push(b))
        if asm.stop_sequence:
            break
    deltas.append(asm.finish())
    return [d for d in deltas if d], asm


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo € 👋 ok"
    deltas, asm = _stream(text)
    assert "".join(deltas) == text == asm.text
    assert all("\ufffd" not in d for d in deltas)
    assert "€" in deltas and "👋" in deltas  # released whole, once complete


def test_stop_string_is_cut_and_never_streamed() -> None:
    deltas, asm = _stream("alpha STOP beta", ["STOP", "zzzz"])
    assert asm.stop_sequence == "STOP" and "".join(deltas) == "alpha " == asm.text


def test_special_tokens_are_skipped_in_text() -> None:
    asm = TextAssembler(TOK)
    out = asm.push(ord("a")) + asm.push(EOS) + asm.push(ord("b")) + asm.finish()
    assert out == "ab"


def test_chat_rendering_and_content_blocks() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    text = render_chat(msgs, TOK)
    assert (
        text == "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = render_ids(msgs, TOK)
    assert TOK.decode(ids) == text


def test_breakpoint_token_ends() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    ids = render_ids(msgs, TOK)
    ends = breakpoint_token_ends(msgs, [(0, None), (1, 0), (1, 1)], TOK)
    decoded = [TOK.decode(ids[:e]) for e in ends]
    # a message's last block ends after the template's closing tag (shared with later prompts)
    assert decoded[0].endswith("Be brief.<|im_end|>\n")
    assert decoded[1].endswith("Hello ")
    assert decoded[2].endswith("Hello there<|im_end|>\n")
    assert ends == sorted(ends) and ends[-1] < len(ids)
