"""Replicas behind the routers other projects wrote, the real binaries (PyPI ``smg`` and
``vllm-router``, the ``routers`` extra): SMG ``cache_aware`` and vllm-router ``kv_aware`` (fed the
replicas' KV events) keep each shared prefix on one replica, the cached tokens the answers report
through them are the replicas' own hit counters, both APIs stream, and no probe either router
sends is answered 404. Replicas run in-process (tiny model; SmolLM2 in the last test), each
behind a recorder of every request it gets.

A missing binary skips these tests, and fails them under CI (``require_router``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest

from prefixcache.cache import PrefixCache
from prefixcache.commands.ext_routers import (
    INSTALL_HINT,
    EventSource,
    RouterProcess,
    find_router,
    router_command,
)
from prefixcache.engine.engine import Engine
from prefixcache.kvevents.publisher import KVEventPublisher, PublisherConfig
from prefixcache.server import create_app
from prefixcache.server.compat.kv_blocks import enable_kv_events

from .conftest import ServerThread, free_port

MODEL = "tiny"
SYSTEMS = [
    f"You are assistant number {i} of Acme Corp, department {d}. Answer in one short sentence. " * 4
    for i, d in enumerate(("billing", "shipping", "returns", "warranty"))
]
GENERATION_PATHS = ("/v1/chat/completions", "/v1/messages")


@dataclass
class Recorded:
    """What one replica was asked: every (method, path, status), and the system prompt of
    every generation request."""

    name: str
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    systems: list[str] = field(default_factory=list)


def recording(app: Any, rec: Recorded) -> Any:
    """An ASGI wrapper that records ``rec`` (the body of a generation request is read as it passes)."""

    async def wrapped(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        status: dict[str, int] = {}
        body = bytearray()

        async def listen() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body") and scope["path"] in GENERATION_PATHS and body:
                    data = json.loads(bytes(body))  # recorded before the answer goes out
                    system = data.get("system") or data["messages"][0]["content"]
                    rec.systems.append(system if isinstance(system, str) else json.dumps(system))
            return message

        async def answer(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        await app(scope, listen, answer)
        rec.calls.append((scope["method"], scope["path"], status.get("code", 0)))

    return wrapped


@dataclass
class Replica:
    engine: Engine
    server: ServerThread
    publisher: KVEventPublisher
    rec: Recorded

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def router_front(require_binary: Callable[[str, str], str]) -> Callable[..., RouterProcess]:
    """``router_front(name, replicas, model)``: router ``name`` in front of the replicas (not yet
    started). A missing binary is a skip, or under CI a failure naming the extra."""

    def make(name: str, reps: list[Replica], model: str = MODEL) -> RouterProcess:
        try:
            binary = find_router(name)
        except ValueError:
            binary = require_binary(name, INSTALL_HINT)
        port = free_port()
        events = [EventSource(r.url, r.publisher.endpoint, r.publisher.replay_endpoint) for r in reps]
        urls = [r.url for r in reps]
        cmd = router_command(name, binary, urls, host="127.0.0.1", port=port, events=events, model=model)
        if name == "smg":
            cmd += ["--load-monitor-interval", "1"]
        return RouterProcess(cmd, f"http://127.0.0.1:{port}", ready_s=90)

    return make


@pytest.fixture
def replicas(tiny_runner: Any) -> Iterator[Callable[..., list[Replica]]]:
    started: list[Replica] = []

    def start(n: int = 2, runner: Any = None, model: str = MODEL) -> list[Replica]:
        for i in range(n):
            engine = Engine(
                runner or tiny_runner,
                prefill_chunk=16,
                cache=PrefixCache(block_size=16, capacity_bytes=1 << 28),
            )
            app = create_app(engine, model_name=model)
            pub = f"tcp://127.0.0.1:{free_port()}"
            publisher = KVEventPublisher(PublisherConfig(pub, f"tcp://127.0.0.1:{free_port()}"))
            enable_kv_events(app, publisher)
            rec = Recorded(f"replica-{i}")
            server = ServerThread(recording(app, rec)).__enter__()
            started.append(Replica(engine, server, publisher, rec))
        return started[-n:]

    yield start
    for r in started:
        r.server.__exit__()
        r.publisher.close()
        r.engine.close()


def chat(client: openai.OpenAI, system: str, user: str, model: str = MODEL) -> int:
    r = client.chat.completions.create(
        model=model,
        max_tokens=1,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )
    return r.usage.prompt_tokens_details.cached_tokens


def hit_tokens(reps: list[Replica]) -> int:
    return sum(r.engine.stats().hit_tokens for r in reps)


def no_404(reps: list[Replica]) -> None:
    missing = sorted({(m, p) for r in reps for m, p, s in r.rec.calls if s == 404})
    assert not missing, f"probes answered 404: {missing}"


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def run_shared_prefix_workload(base: str, reps: list[Replica], rounds: int = 3) -> int:
    """Each system prompt ``rounds`` times (a new question each time), interleaved; returns the
    cached tokens the answers reported. Asserts each prompt stayed on one replica."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    reported = 0
    for j in range(rounds):
        for i, system in enumerate(SYSTEMS):
            reported += chat(client, system, f"Question {j} about case {i}?")
    for system in SYSTEMS:
        holders = [r.rec.name for r in reps if system in r.rec.systems]
        assert len(holders) == 1, f"a prefix was served by {holders}"
    return reported


def both_apis_stream_with_cache_usage(base: str, reps: list[Replica]) -> None:
    """Streams on both APIs, and the cached tokens in their usage (OpenAI's last chunk,
    Anthropic's message_start) are what the replicas read from their caches."""
    before = hit_tokens(reps)
    oa = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    stream = oa.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Streamed?"}],
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage is not None
    streamed_cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert streamed_cached > 0  # SYSTEMS[0] is cached where the router sends it

    an = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    read = []
    for k in range(4):  # 4 requests on 2 replicas: one replica gets a second, which reads the first
        with an.messages.stream(
            model=MODEL,
            max_tokens=4,
            system=SYSTEMS[3] + " (Anthropic)",
            messages=[{"role": "user", "content": f"Anthropic question {k}"}],
        ) as s:
            events = [e.type for e in s]
            final = s.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        read.append(final.usage.cache_read_input_tokens)
    assert max(read) > 0
    assert hit_tokens(reps) - before == streamed_cached + sum(read)  # reported = the replicas' own reads


@pytest.mark.parametrize("name", ["smg", "vllm-router"])
def test_a_router_keeps_each_prefix_on_one_replica_and_reports_the_replicas_hits(
    name, replicas, router_front
) -> None:
    reps = replicas(2)
    with router_front(name, reps) as router:
        reported = run_shared_prefix_workload(router.url, reps)
        assert reported == hit_tokens(reps) > 0  # what the answers said is what the replicas read
        # Each prompt's repeats are hits: 3 rounds of 4 prompts, rounds 2 and 3 read the system prompt.
        assert all(r.engine.stats().hit_tokens > 0 for r in reps if r.rec.systems)
        both_apis_stream_with_cache_usage(router.url, reps)
        if name == "smg":  # it polls each replica's load (SMG 1.13: GET /loads?model=...), answered
            polled = {("GET", "/loads", 200), ("GET", "/v1/loads", 200), ("GET", "/metrics", 200)}
            wait_for(lambda: all(polled & set(r.rec.calls) for r in reps), "SMG's load poll")
            asked = {p for r in reps for _, p, _ in r.rec.calls}
            assert "/version" in asked and "/v1/models" in asked
        else:  # kv_aware asks a replica for the request's tokens, and gets them
            renders = [c for r in reps for c in r.rec.calls if c[1] == "/v1/chat/completions/render"]
            assert renders and all(s == 200 for _, _, s in renders)
    no_404(reps)


def test_vllm_router_routes_by_the_blocks_the_replicas_events_announce(replicas, router_front) -> None:
    """Prefixes cached on a replica behind the router's back (sent to it directly) are known to
    kv_aware only through that replica's BlockStored events: each goes back to its holder (two
    prefixes per replica, so no tie-break or load rule gets all four right but by 1 in 16)."""
    reps = replicas(2)
    with router_front("vllm-router", reps) as router:
        holders = {system: reps[i % 2] for i, system in enumerate(SYSTEMS)}
        for system, rep in holders.items():
            direct = openai.OpenAI(base_url=rep.url + "/v1", api_key="none", max_retries=0)
            chat(direct, system, "Direct question")
        for rep in reps:  # every block the replica holds has gone out as a BlockStored
            held = rep.engine.stats().blocks
            sent = rep.publisher.stats
            wait_for(lambda sent=sent, held=held: sent.stored_blocks >= held, "the BlockStored events")
        time.sleep(1.0)  # published; give the router's subscriber a moment to index them
        routed = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        for system, rep in holders.items():
            served_before = len(rep.rec.systems)
            assert chat(routed, system, "Routed question") > 0
            assert len(rep.rec.systems) == served_before + 1, "not sent to the replica holding its blocks"
    no_404(reps)


@pytest.mark.model
def test_vllm_router_kv_aware_over_smollm2_replicas(replicas, real_runner, router_front) -> None:
    """The real tokenizer: kv_aware hashes the rendered tokens and the events' token ids alike, so
    a repeated prefix goes back to the replica whose events hold it."""
    reps = replicas(2, runner=real_runner, model="smollm2")
    with router_front("vllm-router", reps, model="smollm2") as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        first = [chat(client, s, "Hi", model="smollm2") for s in SYSTEMS[:2]]
        assert first == [0, 0]
        for r in reps:  # the BlockStored events are in before the repeats are routed
            wait_for(lambda r=r: r.publisher.stats.batches > 1 or not r.rec.systems, "the replicas' events")
        time.sleep(0.5)
        again = [chat(client, s, "Hello again", model="smollm2") for s in SYSTEMS[:2]]
        assert all(c > 0 for c in again)
        for system in SYSTEMS[:2]:
            assert len([r for r in reps if system in r.rec.systems]) == 1
        r = httpx.post(
            reps[0].url + "/v1/chat/completions/render",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert r.json()["token_ids"] == reps[0].engine.render_ids([{"role": "user", "content": "Hi"}])
    no_404(reps)


def test_a_missing_router_binary_is_one_line_naming_the_extra(monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    from prefixcache.cli import app

    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))  # nothing beside it
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match=r"smg is not installed: pip install 'prefixcache\[routers\]'"):
        find_router("smg")
    result = CliRunner().invoke(app, ["cluster", "--router", "vllm-router", "--no-redis"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["prefixcache cluster: vllm-router is not installed: pip install 'prefixcache[routers]' "
                     "(the routers extra)"]  # fmt: skip


def test_a_missing_router_binary_fails_its_tests_under_ci(router_front, monkeypatch, tmp_path) -> None:
    """The rule of every binary the suite needs: without it a CI run goes red, never green with skips."""
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match=r"smg is not on PATH.*prefixcache\[routers\]"):
        router_front("smg", [])
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="vllm-router"):
        router_front("vllm-router", [])


@pytest.mark.model
def test_cluster_command_with_vllm_router_answers_and_stops_on_sigterm(tmp_path, require_binary) -> None:
    """``prefixcache cluster --router vllm-router`` as a user runs it: the replica with KV events,
    vllm-router in front subscribed to them, a repeat answered from the cache through it, and
    SIGTERM stopping both (exit status 0, no process left)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    import prefixcache

    from .conftest import stop_process_tree, wait_http

    try:
        find_router("vllm-router")
    except ValueError:
        require_binary("vllm-router", INSTALL_HINT)
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(prefixcache.__file__).resolve().parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "cluster.log"
    cmd = [sys.executable, "-m", "prefixcache", "cluster", "--router", "vllm-router", "--replicas", "1"]
    cmd += ["--no-redis", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=300)
            wait_for(lambda: "Ctrl-C stops all" in log.read_text(), "the cluster's ready line", 120)
        except (RuntimeError, AssertionError):
            raise AssertionError(log.read_text()[-3000:]) from None
        assert "vllm-router (kv_aware, KV events)" in log.read_text()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 2, [c.name() for c in children]  # the replica and vllm-router
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        first = chat(client, SYSTEMS[0], "Hi", model="smollm2-135m-instruct")
        again = chat(client, SYSTEMS[0], "Hi", model="smollm2-135m-instruct")
        assert first == 0 and again > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        stop_process_tree(proc)
