"""Small pieces without a server: breakpoint positions, the serve command's options, sizes."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.commands.server import parse_bytes
from prefixcache.server.anthropic.prompt import to_messages, ttl_plan
from prefixcache.server.anthropic.schemas import MessagesRequest
from prefixcache.server.errors import APIError


def test_breakpoints_map_to_the_token_ends_of_their_blocks(make_engine):
    engine = make_engine()  # byte tokenizer: positions are easy to state
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "system": [
                {"type": "text", "text": "AAAA", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"type": "text", "text": "BBBB"},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "CC", "cache_control": {"type": "ephemeral"}},
                        {"type": "text", "text": "DD"},
                    ],
                }
            ],
        }
    )
    messages, bps = to_messages(req)
    assert messages == [{"role": "system", "content": "AAAABBBB"}, {"role": "user", "content": "CCDD"}]
    full = engine.render_ids(messages)

    def render_cut(cut, _tools_end):
        return engine.render_ids(list(cut), add_generation_prompt=False)

    plan = ttl_plan(messages, bps, full, render_cut, 0)
    text = engine.render(messages)

    def upto(marker: str) -> int:
        return len(engine.tokenize(text[: text.index(marker) + len(marker)]))

    assert plan == [(upto("AAAA"), 3600.0), (upto("CC"), 300.0)]


def test_top_level_cache_control_covers_the_whole_prompt(make_engine):
    engine = make_engine()
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
            "messages": [{"role": "user", "content": "hello"}],
        }
    )
    messages, bps = to_messages(req)
    full = engine.render_ids(messages)
    assert ttl_plan(messages, bps, full, lambda m, _: engine.render_ids(list(m)), 0) == [(len(full), 3600.0)]


def test_more_than_four_breakpoints_is_an_api_error():
    cc = {"type": "ephemeral"}
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "cache_control": cc,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": str(i), "cache_control": cc} for i in range(4)],
                }
            ],
        }
    )
    with pytest.raises(APIError, match="at most 4"):
        to_messages(req)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1048576") == 1 << 20
    with pytest.raises(typer.BadParameter):
        parse_bytes("lots")


def test_serve_help_lists_every_option():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for flag in (
        "--host",
        "--port",
        "--api-keys",
        "--max-queue",
        "--trace-log",
        "--trace-text",
        "--ttl",
        "--capacity",
        "--salt-secret",
        "PREFIXCACHE_SALT_SECRET",
    ):
        assert flag in result.output


def test_engine_errors_become_client_errors():
    from prefixcache.engine import InvalidRequestError, PromptTooLongError, QueueFullError
    from prefixcache.server.bridge import translate_error

    full = translate_error(QueueFullError("full"))
    assert full is not None and (full.status, full.anthropic_status) == (429, 529)
    too_long = translate_error(PromptTooLongError("the prompt has 9000 tokens"))
    assert too_long is not None and too_long.status == 400 and "9000" in too_long.message
    assert translate_error(InvalidRequestError("top_p")).status == 400
    assert translate_error(RuntimeError("a bug")) is None  # a real bug stays a 500, logged


def test_anthropic_stop_reasons():
    from prefixcache.server.anthropic.routes import stop_reason
    from prefixcache.server.bridge import Finished, Usage

    usage = Usage(10, 0, 0, 3)
    assert stop_reason(Finished("a", "length", usage, 0.1, "miss")) == ("max_tokens", None)
    assert stop_reason(Finished("a", "stop", usage, 0.1, "miss", stop_sequence="\n\n")) == (
        "stop_sequence",
        "\n\n",
    )
    assert stop_reason(Finished("a", "stop", usage, 0.1, "miss")) == ("end_turn", None)
