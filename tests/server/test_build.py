"""``build_server(ServerConfig)``, the library call ``serve`` maps its flags to: it serves, its
``close`` leaves the disk tier holding what a rebuilt server then hits, and a setting it cannot
build is a :class:`BuildError` naming the option, with everything opened closed; the KV event
publisher it binds from the config is closed with the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import RunningServer

from prefixcache.commands.redis_process import free_port
from prefixcache.engine.config import EngineConfig
from prefixcache.server.build import (
    AppConfig,
    BuildError,
    KVEventsConfig,
    ServerConfig,
    TierConfig,
    build_server,
)

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


def bindable(endpoint: str) -> bool:
    """Whether a publisher can bind ``endpoint`` now (False while another holds it). No retry:
    a closed publisher has released its address when ``close`` returns."""
    from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig

    try:
        KVEventPublisher(PublisherConfig(endpoint)).close()
    except ValueError:
        return False
    return True


def test_build_server_opens_the_kv_event_publisher_and_close_closes_it(
    tiny_runner: Any, one_torch_thread: None
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = ServerConfig(
        model=tiny_runner,
        engine=EngineConfig(prefill_chunk=16),
        kv_events=KVEventsConfig(endpoint=endpoint, hash_format="bytes", buffer=64),
    )
    server = build_server(config)
    try:
        pub = server.publisher
        assert pub is not None and pub.endpoint == endpoint and pub.config.buffer_steps == 64
        assert f"KV events on {endpoint} (bytes hashes, CPU)" in server.describe()
        assert not bindable(endpoint)  # bound by the server's publisher, attached to its cache
        assert server.app.state.kv_events is pub  # attached to the engine's cache, on /metrics
    finally:
        server.close()
    assert bindable(endpoint)
    plain = build_server(ServerConfig(model=tiny_runner, engine=EngineConfig(prefill_chunk=16)))
    try:
        assert plain.publisher is None and "KV events" not in " ".join(plain.describe())
    finally:
        plain.close()


def test_a_setting_that_cannot_be_built_names_its_option_and_closes_the_publisher(
    tiny_runner: Any, one_torch_thread: None
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = KVEventsConfig(endpoint=endpoint)
    bad_chunk = ServerConfig(model=tiny_runner, engine=EngineConfig(prefill_chunk=24), kv_events=events)
    with pytest.raises(BuildError, match=r"prefill_chunk \(24\) must be a positive multiple") as bad:
        build_server(bad_chunk)
    assert bad.value.option is None and bindable(endpoint)

    no_cache = ServerConfig(
        model=tiny_runner, engine=EngineConfig(prefill_chunk=16, enable_cache=False), kv_events=events
    )
    with pytest.raises(BuildError, match="KV events need the prompt cache") as bad:
        build_server(no_cache)
    assert bad.value.option == "--kv-events-endpoint" and bindable(endpoint)

    for kv, option in (
        (KVEventsConfig(replay_endpoint=endpoint), "--kv-events-replay-endpoint"),
        (KVEventsConfig(endpoint=endpoint, hash_format="hex"), "--kv-events-hash-format"),
        (KVEventsConfig(endpoint=endpoint, curve_clients="keys"), "--kv-events-curve-clients"),
        (KVEventsConfig(endpoint="tcp://0.0.0.0:0"), "--kv-events-endpoint"),
    ):
        with pytest.raises(BuildError) as bad:  # before the model loads
            build_server(ServerConfig(model=tiny_runner, kv_events=kv))
        assert bad.value.option == option


def test_serve_flags_default_to_the_library_defaults() -> None:
    """``serve`` only maps flags to the config: a flag's default is the config's (the engine's,
    the tiers', the app's), so changing a default in its home changes what ``serve`` runs."""
    import inspect

    from prefixcache.commands.options import duration
    from prefixcache.commands.server import parse_bytes, serve
    from prefixcache.engine.config import DEFAULT_VERIFY_RATE

    flags = {name: p.default for name, p in inspect.signature(serve).parameters.items()}
    config, engine, tiers, app = ServerConfig(), EngineConfig(), TierConfig(), AppConfig()
    assert {
        "block_size": flags["block_size"],
        "prefill_chunk": flags["prefill_chunk"],
        "runner": flags["runner"],
        "dtype": flags["dtype"],
        "weights": flags["weights"],
        "capacity_bytes": parse_bytes(flags["capacity"]),
        "default_ttl_s": duration(flags["ttl"]),
        "miss_reasons": flags["miss_reasons"],
        "max_queue": flags["max_queue"],
        "max_batch": flags["max_batch"],
        "threads": flags["threads"],
    } == {
        "block_size": engine.block_size,
        "prefill_chunk": engine.prefill_chunk,
        "runner": engine.runner,
        "dtype": engine.dtype,
        "weights": engine.weights,
        "capacity_bytes": engine.capacity_bytes,
        "default_ttl_s": engine.default_ttl_s,
        "miss_reasons": engine.miss_reasons,
        "max_queue": engine.max_queue,
        "max_batch": engine.max_batch,
        "threads": engine.threads,
    }
    assert flags["verify_rate"] == DEFAULT_VERIFY_RATE  # serve audits; the library's default is off
    assert (
        parse_bytes(flags["disk_cache_size"]),
        flags["redis_max_ttl"],
        flags["redis_sync_writes"],
        flags["tier_encrypt"],
    ) == (tiers.disk_bytes, tiers.redis_max_ttl_s, tiers.redis_sync_writes, tiers.encrypt)
    assert (
        flags["tenant_queue_share"],
        flags["tenant_pin_share"],
        flags["tenant_capacity_share"],
        flags["busting_window"],
        flags["trace_text"],
        flags["trace_keys_only"],
    ) == (
        app.tenant_queue_share,
        app.tenant_pin_share,
        app.tenant_capacity_share,
        app.busting_window,
        app.trace_text,
        app.trace_keys_only,
    )
    assert (flags["host"], flags["port"], flags["log_level"]) == (config.host, config.port, config.log_level)
    events = config.kv_events
    assert (
        flags["kv_events_endpoint"],
        flags["kv_events_replay_endpoint"],
        flags["kv_events_topic"],
        flags["kv_events_buffer"],
        flags["kv_events_hash_format"],
        flags["kv_events_curve_secret_file"],
        flags["kv_events_curve_clients"],
        flags["kv_events_allow_unauthenticated"],
    ) == (
        events.endpoint,
        events.replay_endpoint,
        events.topic,
        events.buffer,
        events.hash_format,
        events.curve_secret_file,
        events.curve_clients,
        events.allow_unauthenticated,
    )
