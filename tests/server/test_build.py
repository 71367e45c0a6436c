"""``build_server(ServerConfig)``, the library call ``serve`` maps its flags to: it serves, its
``close`` leaves the disk tier holding what a rebuilt server then hits, and a setting it cannot
build is a :class:`BuildError` naming the option, with everything it was given closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import RunningServer

from prefixcache.engine.config import EngineConfig
from prefixcache.server.build import AppConfig, BuildError, ServerConfig, TierConfig, build_server

SECRET = "a-deployment-salt-secret-0123456789"
SYSTEM = "A stable system prompt, long enough to fill several sixteen-token blocks. " * 4


def ask(url: str) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(
        model="test-model",
        max_tokens=3,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
    )


def test_a_built_server_serves_and_after_close_a_rebuilt_one_hits_its_disk_tier(
    tiny_runner: Any, tmp_path: Path, one_torch_thread: None
) -> None:
    config = ServerConfig(
        model=tiny_runner,
        engine=EngineConfig(prefill_chunk=16, max_queue=8),
        tiers=TierConfig(disk_dir=tmp_path / "disk"),
        app=AppConfig(salt_secret=SECRET, model_name="test-model"),
        port=8123,
    )
    first = build_server(config)
    try:
        assert first.describe()[1:] == [
            "cache tiers below memory: disk",
            "serving 'test-model' on http://127.0.0.1:8123 "
            "(OpenAI and Anthropic routes, /metrics, /dashboard)",
        ]
        assert (
            first.app.state.prefixcache.bridge.admission.max_queue == 8
        )  # the engine's queue bound is the app's
        live = RunningServer(first.app, first.engine).start()
        cold = ask(live.url)
        live.stop()
    finally:
        first.close()
    first.close()  # idempotent
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    full_blocks = (cold.usage.prompt_tokens - 1) // 16 * 16

    second = build_server(config)  # a new engine: empty memory, the same disk directory
    try:
        live = RunningServer(second.app, second.engine).start()
        warm = ask(live.url)
        live.stop()
    finally:
        second.close()
    assert warm.usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


class SpyPublisher:
    """Stands in for a bound KVEventPublisher on the error path: records ``close``."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"medium": None})()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_setting_that_cannot_be_built_names_its_option_and_closes_what_it_was_given(
    tiny_runner: Any, one_torch_thread: None
) -> None:
    spy = SpyPublisher()
    with pytest.raises(BuildError, match=r"prefill_chunk \(24\) must be a positive multiple") as bad:
        build_server(ServerConfig(model=tiny_runner, engine=EngineConfig(prefill_chunk=24)), spy)  # type: ignore[arg-type]
    assert bad.value.option is None and spy.closed == 1

    spy = SpyPublisher()
    no_cache = ServerConfig(model=tiny_runner, engine=EngineConfig(prefill_chunk=16, enable_cache=False))
    with pytest.raises(BuildError, match="KV events need the prompt cache") as bad:
        build_server(no_cache, spy)  # type: ignore[arg-type]
    assert bad.value.option == "--kv-events-endpoint" and spy.closed == 1
