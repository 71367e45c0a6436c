"""The low items of issue 21, one named regression test each: a token id past 32 bits with
``echo`` is a 400; a tool call of a thousand nested brackets is text, not a 500; a chat
template's ``raise_exception`` is a 400 naming ``messages``; busting warnings quote no prompt
text under the trace's privacy mode; a keep-warm file holding API keys must not be readable by
others; the router's logs redact its keys."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "test-model"


def _post(server: Any, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


class _HFLikeDecode:
    """The tiny tokenizer, decoding as Hugging Face's fast tokenizers do: an id past 32 bits
    overflows (``OverflowError: out of range integral type conversion attempted``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, ids: Any, **kw: Any) -> str:
        if any(i >= 1 << 32 for i in ids):
            raise OverflowError("out of range integral type conversion attempted")
        return self.inner.decode(ids, **kw)


def test_a_token_id_past_32_bits_with_echo_is_a_400(serve, make_engine, monkeypatch):
    engine = make_engine()
    monkeypatch.setattr(engine.runner, "tokenizer", _HFLikeDecode(engine.runner.tokenizer))
    server = serve(engine, model_name=MODEL)
    r = _post(
        server, "/v1/completions", {"model": MODEL, "prompt": [4294967296], "echo": True, "max_tokens": 1}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "invalid_token_id"
    assert "4294967296" in error["message"] and "vocabulary" in error["message"]


@pytest.mark.model
def test_a_token_id_past_32_bits_with_echo_is_a_400_on_smollm2(serve, real_runner, one_torch_thread):
    from prefixcache.engine import Engine

    engine = Engine(real_runner)
    try:
        server = serve(engine, model_name=MODEL)
        body = {"model": MODEL, "prompt": [4294967296], "echo": True, "max_tokens": 1}
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    finally:
        engine.close()


def test_a_thousand_nested_brackets_in_a_tool_call_are_text_not_a_500():
    from prefixcache.server.tools.calls import parse_tool_calls
    from prefixcache.server.tools.prompt import CallSyntax

    deep = "[" * 1_000 + "]" * 1_000
    args = '{"name": "get", "arguments": ' + deep + "}"
    for syntax, reply in (
        (CallSyntax.TAGGED, f"<tool_call>{args}</tool_call>"),
        (CallSyntax.TAGGED, '<tool_call>{"name": "get", "arguments": "' + deep + '"}</tool_call>'),
        (CallSyntax.JSON, args),
        (CallSyntax.JSON, deep),
    ):
        parsed = parse_tool_calls(reply, {"get"}, syntax)
        assert parsed.calls == [] and parsed.text == reply


class _RefusingTemplate:
    """The tiny tokenizer with a chat template that refuses, as transformers' ``raise_exception``
    does (a ``jinja2.exceptions.TemplateError``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, *args: Any, **kw: Any) -> Any:
        from jinja2.exceptions import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_chat_templates_raise_exception_is_a_400_naming_messages(serve, make_engine, monkeypatch, path):
    engine = make_engine()
    monkeypatch.setattr(engine.runner, "tokenizer", _RefusingTemplate(engine.runner.tokenizer))
    server = serve(engine, model_name=MODEL)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    body: dict = {"model": MODEL, "max_tokens": 1, "messages": messages}
    if path == "/v1/responses":
        body = {"model": MODEL, "max_output_tokens": 1, "input": messages}
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    text = r.text
    assert "Conversation roles must alternate" in text and "'messages'" in text
    if path != "/v1/messages":
        assert r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("keys_only", [False, True])
def test_busting_warnings_quote_no_prompt_text_under_the_privacy_mode(
    serve, make_engine, caplog, tmp_path, keys_only
):
    from test_server_busting import QUESTIONS, STAMPS, _messages

    caplog.set_level(logging.WARNING, logger="prefixcache.server.ops.busting")
    trace = tmp_path / "trace.jsonl"
    server = serve(make_engine(), model_name=MODEL, trace_log=trace, trace_keys_only=keys_only)
    for stamp, question in zip(STAMPS, QUESTIONS, strict=True):
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": _messages(stamp, question)}
        assert _post(server, "/v1/chat/completions", body).status_code == 200
    server.state.busting.wait_idle()
    [warning] = [r.getMessage() for r in caplog.records if r.name == "prefixcache.server.ops.busting"]
    assert "timestamp" in warning
    quoted = [s for s in STAMPS if s in warning]
    assert (quoted == []) is keys_only, warning
    if keys_only:
        assert "(withheld)" in warning


def test_a_keep_warm_file_with_keys_must_not_be_readable_by_others(tmp_path: Path):
    from prefixcache.router.keepwarm import KeepWarm

    policy = tmp_path / "warm.json"
    policy.write_text('{"prefixes": [{"prompt": "hello", "api_key": "sk-warm-0123456789"}]}')
    os.chmod(policy, 0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        KeepWarm.load(policy)
    os.chmod(policy, 0o600)
    assert KeepWarm.load(policy).prefixes[0].api_key == "sk-warm-0123456789"
    keyless = tmp_path / "open.json"
    keyless.write_text('{"prefixes": [{"prompt": "hello"}]}')
    os.chmod(keyless, 0o644)
    assert KeepWarm.load(keyless).prefixes[0].api_key is None  # nothing secret in it


def test_the_routers_logs_redact_its_keys(monkeypatch, tmp_path: Path, capsys):
    import uvicorn

    from prefixcache.commands import router_security

    seen: list[str] = []

    def run(self: Any) -> None:  # the server "runs": something logs a key on every handler
        logging.getLogger("uvicorn.error").warning("refused key sk-router-0123456789 from a client")
        logging.getLogger("prefixcache.router").warning("keep-warm with sk-warm-0123456789 failed")
        for handler in logging.getLogger("uvicorn.error").handlers + logging.getLogger().handlers:
            seen.extend(type(f).__name__ for f in handler.filters)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    router_security.serve_router(
        object(),
        host="127.0.0.1",
        port=0,
        log_level="info",
        max_connections=8,
        secrets=["sk-router-0123456789", "sk-warm-0123456789"],
    )
    out = capsys.readouterr()
    text = out.out + out.err
    assert "refused key ***" in text and "sk-router-0123456789" not in text
    assert "RedactSecrets" in seen
