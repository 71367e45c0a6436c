"""The ``x-prefixcache-blocks`` answer tokenizes the prompt once: the ids computed for the
router's block hashes are the ids the engine is handed (it does not tokenize them again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from server_helpers import RunningServer, Scripted

from prefixcache.server import create_app
from prefixcache.server.compat.kv_blocks import BLOCKS_HEADER, WANT_HEADER, PromptBlocks, blocks_header

MODEL = "tiny-llama"
WANT = {WANT_HEADER: "1"}


class _Counting:
    """Counts the prompt tokenizations the server asks of the engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def tokenize(self, text: str) -> Any:
        self.calls += 1
        return self.engine.tokenize(text)

    def render_ids(self, messages: Any, **kw: Any) -> Any:
        self.calls += 1
        return self.engine.render_ids(messages, **kw)


@pytest.fixture
def blocks_server(make_engine: Callable[..., Any]) -> Iterator[tuple[RunningServer, Scripted, _Counting]]:
    counting = _Counting(make_engine())
    scripted = Scripted(counting, reply=None)
    app = create_app(scripted, model_name=MODEL)
    app.add_middleware(PromptBlocks)
    server = RunningServer(app, scripted).start()
    yield server, scripted, counting
    server.stop()


def _expected(server: RunningServer, ids: list[int]) -> str:
    cache = server.state.bridge.cache
    tenant = server.state.auth.authenticate(None, None)  # no keys: the default tenant
    ns = server.state.bridge.namespace(tenant.name, tenant.salt)
    return blocks_header(len(ids), cache.block_size, cache.block_keys(ids, ns))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_blocks_asked_hands_the_engine_the_ids_it_hashed(
    blocks_server: tuple[RunningServer, Scripted, _Counting], stream: bool
) -> None:
    server, scripted, counting = blocks_server
    messages = [{"role": "user", "content": "A prompt long enough for a few full blocks. " * 3}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": stream}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=WANT, timeout=60)
    assert r.status_code == 200, r.text
    sent = scripted.requests[-1]
    ids = scripted.results[-1].prompt_token_ids
    assert sent["messages"] is None and sent["prompt"] is None and list(sent["prompt_token_ids"]) == ids
    assert counting.calls == 1  # the header's tokenization, and no other
    assert r.headers[BLOCKS_HEADER] == _expected(server, ids)


def test_completions_with_blocks_asked_and_without(
    blocks_server: tuple[RunningServer, Scripted, _Counting],
) -> None:
    server, scripted, counting = blocks_server
    body = {"model": MODEL, "prompt": "Plain completion text, tokenized once. " * 3, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=WANT, timeout=60)
    assert r.status_code == 200, r.text
    ids = scripted.results[-1].prompt_token_ids
    assert scripted.requests[-1]["prompt"] is None and list(scripted.requests[-1]["prompt_token_ids"]) == ids
    assert counting.calls == 1
    assert r.headers[BLOCKS_HEADER] == _expected(server, ids)
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60)  # nobody asked
    assert plain.status_code == 200 and BLOCKS_HEADER not in plain.headers
    assert scripted.requests[-1]["prompt"] == body["prompt"]  # the engine tokenizes it, once
    assert counting.calls == 1
