"""Fuzzing every route of a live server: whatever the request, the answer is a 2xx or a 4xx whose
body is JSON in the route's error shape with a message, never a 5xx, a hang, an error event
inside a 200 stream, or an exception logged past the handlers.

Three generators: schemathesis from the OpenAPI schema; hand-written hypothesis strategies for
each route's schema with unicode and number edge cases (``fuzz_strategies``); raw bodies that are
not JSON. All run randomized (``derandomize=False``, a new seed each run): a failure names the
seed, and ``PREFIXCACHE_FUZZ_SEED=N`` reruns exactly those inputs (hypothesis also prints a
``@reproduce_failure`` blob, and replays failures from its database first). The ``server-fuzz``
settings profile bounds a run (about a minute on two cores); ``PREFIXCACHE_FUZZ_EXAMPLES=500``
hunts longer.
The inputs of issue 11 are named regression tests at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from fuzz_checks import FUZZ, RERUN, SCHEMA_FUZZ, SEED, ErrorLog, check_answer, collecting_errors
from fuzz_strategies import BODIES, BODILESS, RAW_BODIES, encode
from hypothesis import given, seed
from hypothesis import strategies as st
from server_helpers import RunningServer

from prefixcache.server import create_app

MODEL = "test-model"
schema = schemathesis.openapi.from_dict(create_app(None, model_name=MODEL).openapi())
schema.config.generation.update(
    modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
    deterministic=False,
    database="none",
)


@pytest.fixture(scope="module")
def live(tiny_runner: Any) -> Iterator[RunningServer]:
    import torch

    from prefixcache.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see conftest.make_engine
    # Fuzzed bodies ask for up to a million tokens; the tiny model's 2,048-token context turns
    # most of those into a 400 at once, and the rest decode fast.
    engine = Engine(tiny_runner, prefill_chunk=16)
    server = RunningServer(create_app(engine, model_name=MODEL, max_queue=8), engine).start()
    print(RERUN)  # shown with -s, and with the output of a failing test
    yield server
    server.stop()
    engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def error_log(live: RunningServer) -> Iterator[ErrorLog]:
    with collecting_errors("prefixcache", "uvicorn.error") as handler:
        yield handler


CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 6
    + ["application/json; charset=utf-8", "text/plain", "application/vnd.api+json", "multipart/form-data", ""]
)


def test_the_fuzzers_reach_every_route_of_the_app():
    """Every route that takes a body has a body strategy (edge-case and hostile raw bodies), and
    every other route is fuzzed as bodiless: a route added later fails here until it is."""
    paths = create_app(None, model_name=MODEL).openapi()["paths"]
    routes = {(m.upper(), path): "requestBody" in op for path, ops in paths.items() for m, op in ops.items()}
    assert sorted(r for r, has_body in routes.items() if has_body and r not in BODIES) == []
    assert sorted(r for r, has_body in routes.items() if not has_body and r not in BODILESS) == []


@schema.parametrize()
@SCHEMA_FUZZ
@seed(SEED)
def test_schema_generated_requests(case, live, error_log):
    response = case.call(base_url=live.url, timeout=60)
    check_answer(case.method, case.path, response, error_log)


@pytest.mark.parametrize(("method", "path"), list(BODIES), ids=[f"{m} {p}" for m, p in BODIES])
@FUZZ
@seed(SEED)
@given(data=st.data())
def test_every_route_answers_edge_case_bodies(live, error_log, method, path, data):
    body = encode(data.draw(BODIES[(method, path)], label="body"))
    content_type = data.draw(CONTENT_TYPES, label="content-type")
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.request(method, live.url + path, content=body, headers=headers, timeout=60)
    check_answer(method, path, r, error_log)


@pytest.mark.parametrize(("method", "path"), list(BODIES), ids=[f"{m} {p}" for m, p in BODIES])
@FUZZ
@seed(SEED)
@given(raw=RAW_BODIES)
def test_every_route_answers_raw_bodies(live, error_log, method, path, raw):
    r = httpx.request(
        method, live.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    check_answer(method, path, r, error_log)


HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=200
)


@pytest.mark.parametrize(("method", "path"), BODILESS, ids=[f"{m} {p}" for m, p in BODILESS])
@FUZZ
@seed(SEED)
@given(
    query=st.dictionaries(st.text(max_size=20), st.text(max_size=200), max_size=2),
    header=HEADER_TEXT,
    raw=RAW_BODIES,
)
def test_bodiless_routes_answer_junk(live, error_log, method, path, query, header, raw):
    value = header.strip(" \t").encode("latin-1")  # HTTP header bytes: any octet but controls
    headers = {"authorization": value, "x-api-key": value, "x-prefixcache-endpoint": value}

    def valid(text: str) -> str:  # a URL carries UTF-8: surrogates cannot be sent
        return text.encode("utf-8", "replace").decode()

    params = {valid(k): valid(v) for k, v in query.items()}
    r = httpx.request(method, live.url + path, params=params, headers=headers, content=raw, timeout=60)
    check_answer(method, path, r, error_log)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize(
    "payload",
    [b"", b"{", b"null", b"[1]", b'"text"', b"\xff\xfe", b'{"model": 1}', b'{"messages": "x"}'],
)
def test_garbage_bodies_are_400(live, error_log, path, payload):
    r = httpx.post(live.url + path, content=payload, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    body = r.json()
    message = body["error"]["message"]
    assert message and (body.get("type") == "error") == path.startswith("/v1/messages")
    check_answer("POST", path, r, error_log)


# ------------------------------------------------------------------ issue 11's inputs, by name

CHAT = b'{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":%s}]%s}'
COMPLETION = b'{"model":"test-model","max_tokens":2,"prompt":%s%s}'
RESPONSE = b'{"model":"test-model","max_output_tokens":2,"input":%s%s}'
COUNT = b'{"model":"test-model","messages":[{"role":"user","content":%s}]%s}'
PIN_PROMPT = b'{"prompt":%s%s}'
SHAPES = {
    "/v1/chat/completions": CHAT,
    "/v1/messages": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSE,
    "/v1/messages/count_tokens": COUNT,
    "/v1/cache/pin": PIN_PROMPT,
}
REGRESSIONS = [
    # (name, path, content, extra fields, status, what the error names)
    ("temperature-1e-40-is-greedy", "/v1/chat/completions", b'"hi"', b',"temperature":1e-40', 200, None),
    ("temperature-1e-40-is-greedy", "/v1/messages", b'"hi"', b',"temperature":1e-40', 200, None),
    ("temperature-1e-40-is-greedy", "/v1/completions", b'"hi"', b',"temperature":1e-40', 200, None),
    ("temperature-1e-40-is-greedy", "/v1/responses", b'"hi"', b',"temperature":1e-40', 200, None),
    ("temperature-denormal-is-greedy", "/v1/chat/completions", b'"hi"', b',"temperature":5e-324', 200, None),
    ("seed-2**64", "/v1/chat/completions", b'"hi"', b',"seed":18446744073709551616', 400, "seed"),
    ("seed-2**64", "/v1/completions", b'"hi"', b',"seed":18446744073709551616', 400, "seed"),
    ("seed-below-int64", "/v1/chat/completions", b'"hi"', b',"seed":-9223372036854775809', 400, "seed"),
    ("seed-minus-1-ok", "/v1/chat/completions", b'"hi"', b',"seed":-1,"temperature":1', 200, None),
    ("nul-in-text-ok", "/v1/chat/completions", b'"a\\u0000b"', b"", 200, None),
    ("nan-temperature", "/v1/chat/completions", b'"hi"', b',"temperature":NaN', 400, "temperature"),
    ("huge-max-tokens", "/v1/chat/completions", b'"hi"', b',"max_tokens":1e999', 400, "max_tokens"),
]
for _path in SHAPES:
    REGRESSIONS.append(("lone-surrogate", _path, b'"\\ud800"', b"", 400, "surrogate"))
    REGRESSIONS.append(("utf8-encoded-surrogate", _path, b'"\xed\xb0\x80"', b"", 400, "surrogate"))
    REGRESSIONS.append(
        (
            "deep-nesting",
            _path,
            b'"hi"',
            b',"metadata":' + b"[" * 100_000 + b"]" * 100_000,
            400,
            "levels deep",
        )
    )


@pytest.mark.parametrize(
    ("name", "path", "content", "extra", "status", "names"),
    REGRESSIONS,
    ids=[f"{r[0]}:{r[1]}" for r in REGRESSIONS],
)
def test_issue_11_inputs(live, error_log, name, path, content, extra, status, names):
    body = SHAPES[path] % (content, extra)
    r = httpx.post(live.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:300]}"
    if names is not None:
        assert names in r.text, f"{name}: {r.text[:300]}"
    check_answer("POST", path, r, error_log)
