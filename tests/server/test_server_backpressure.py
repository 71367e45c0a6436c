"""A full queue answers at once (429 OpenAI / 529 Anthropic); a client that disconnects
mid-stream stops its generation and releases its block references."""

from __future__ import annotations

import json
import socket
import threading

import anthropic
import httpx
import openai
from server_helpers import Gated, held_refs, wait_until

from prefixcache.engine.types import ChoiceDelta

MODEL = "test-model"
MESSAGES = [
    {"role": "system", "content": "A system prompt long enough to fill some blocks. " * 6},
    {"role": "user", "content": "hello"},
]


def test_full_queue_is_429_for_openai_and_529_for_anthropic(serve, make_engine):
    engine = Gated(make_engine())
    server = serve(engine, model_name=MODEL, max_queue=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    results: list[object] = []
    holder = threading.Thread(
        target=lambda: results.append(
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        )
    )
    holder.start()
    engine.entered.wait(30)  # the one slot is taken and the worker is held
    try:
        try:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            raise AssertionError("expected 429")
        except openai.RateLimitError as e:
            assert e.status_code == 429
            assert e.body["code"] == "queue_full" and "retry" in e.body["message"]
        try:
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
            raise AssertionError("expected 529")
        except anthropic.APIStatusError as e:
            assert e.status_code == 529
            message = e.body["error"]["message"]
            assert e.body == {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        # A streaming request is refused before any byte of the stream is sent.
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True},
        )
        assert r.status_code == 429 and r.headers["content-type"].startswith("application/json")
        metrics = httpx.get(server.url + "/metrics").text
        assert "prefixcache_queue_depth 1.0" in metrics
    finally:
        engine.release.set()
        holder.join(30)
    assert len(results) == 1
    # The slot is free again.
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert again.usage.completion_tokens >= 1


def test_disconnect_mid_stream_stops_generation_and_releases_blocks(serve, make_engine):
    engine = Gated(make_engine())
    server = serve(engine, model_name=MODEL)
    cache = engine.cache
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "stream": True, "temperature": 0}
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert '"role":"assistant"' in first
        assert held_refs(cache) > 0  # the running request holds its prompt blocks
    # The client is gone: the server notices, cancels, and the engine's worker, held at its
    # next decode step, sees the cancel and stops. (``resume`` is never set.)
    wait_until(lambda: server.state.bridge.active_streams() == 0, "the stream thread to stop")
    wait_until(lambda: engine.queue_depth == 0, "the engine to drop the request")
    assert engine.steps <= 3  # stopped right after the disconnect, not after 500 tokens
    assert held_refs(cache) == 0
    cache.check_integrity()
    assert server.state.bridge.admission.depth == 0
    # The server still serves, and the prompt blocks were committed before the disconnect.
    engine.release.set()
    r2 = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_anthropic_disconnect_mid_stream_releases_blocks(serve, make_engine):
    engine = Gated(make_engine())
    server = serve(engine, model_name=MODEL)
    body = {
        "model": MODEL,
        "max_tokens": 500,
        "stream": True,
        "temperature": 0,
        "system": MESSAGES[0]["content"],
        "messages": [{"role": "user", "content": "hello"}],
    }
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/messages", json=body) as r:
        assert r.status_code == 200
        assert any(line.startswith("event: message_start") for line in r.iter_lines())
    wait_until(lambda: server.state.bridge.active_streams() == 0, "the stream thread to stop")
    wait_until(lambda: engine.queue_depth == 0, "the engine to drop the request")
    assert engine.steps <= 3
    assert held_refs(engine.cache) == 0
    engine.cache.check_integrity()


def test_disconnect_while_waiting_for_a_whole_answer_cancels_it(serve, make_engine):
    engine = Gated(make_engine())
    engine.release.set()
    engine.hold_generate = True
    server = serve(engine, model_name=MODEL)
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 100}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        assert engine.held.wait(30)  # the request is in the engine
    # The client hung up without reading: the server cancels, the engine lets go.
    wait_until(lambda: engine.queue_depth == 0, "the engine to drop the request")
    wait_until(
        lambda: 'route="/v1/chat/completions",status="499"' in httpx.get(server.url + "/metrics").text,
        "the request to end as 499",
    )
    assert held_refs(engine.cache) == 0
    engine.cache.check_integrity()
    assert server.state.bridge.admission.depth == 0


class _Failing:
    """An engine whose stream breaks after its first delta (a bug or a lost device)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_choices(self, **kw):
        gen = self.engine.stream_choices(**kw)
        try:
            for item in gen:
                yield item
                if isinstance(item, ChoiceDelta):
                    raise RuntimeError("boom")
        finally:
            gen.close()


def test_a_failure_mid_stream_is_an_error_event_and_releases_blocks(serve, make_engine):
    engine = _Failing(make_engine())
    server = serve(engine, model_name=MODEL)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True))
        raise AssertionError("expected an error event")
    except openai.APIError as e:
        assert "RuntimeError" in e.message
    r = httpx.post(
        server.url + "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 5,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert r.status_code == 200 and "event: error" in r.text and "api_error" in r.text
    wait_until(lambda: server.state.bridge.active_streams() == 0, "the stream threads to stop")
    assert held_refs(engine.cache) == 0
    engine.cache.check_integrity()


class _RecordingGate(Gated):
    """:class:`Gated`, keeping each stream's ``cancel`` event (the bridge's, per request)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.cancels: list[threading.Event] = []

    def stream_choices(self, **kw):
        self.cancels.append(kw["cancel"])
        yield from super().stream_choices(**kw)


def test_a_stream_whose_client_leaves_while_queued_is_dropped_without_a_forward_pass(serve, make_engine):
    engine = _RecordingGate(make_engine(max_batch=1))  # one request runs, the next one waits
    server = serve(engine, model_name=MODEL)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "stream": True, "temperature": 0}
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as a:
        lines = a.iter_lines()  # kept: dropping the iterator closes the response (a disconnect)
        assert next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        # A is decoding (held by the gate at its next step); its prompt is all that was prefilled.
        prefilled = engine.prefilled_tokens
        behind = [{"role": "user", "content": "queued behind A " * 8}]
        queued = json.dumps({**body, "messages": behind}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(queued)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + queued)
            wait_until(lambda: engine.queue_depth == 2, "B to wait in the engine's queue")
        # B's client hung up while B waited: the server cancels it ...
        wait_until(lambda: len(engine.cancels) == 2 and engine.cancels[1].is_set(), "B to be cancelled")
        engine.resume.set()  # ... and A runs to its end
        assert any(line == "data: [DONE]" for line in lines)
    wait_until(lambda: engine.queue_depth == 0 and server.state.bridge.active_streams() == 0, "both to end")
    assert engine.prefilled_tokens == prefilled  # B was never prefilled
    wait_until(
        lambda: 'route="/v1/chat/completions",status="499"' in httpx.get(server.url + "/metrics").text,
        "B to end as 499",
    )
    assert server.state.bridge.admission.depth == 0
    assert held_refs(engine.cache) == 0
    engine.cache.check_integrity()
