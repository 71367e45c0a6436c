"""vLLM's token and render routes, the engine probes (/version, /server_info, /model_info,
/v1/loads) and the vllm: gauges: a render's tokens are exactly what generation prefills (proved
through the cache: a token-id prompt of the rendered ids reads what a repeat of the generation
reads), every bad input is a 4xx, and nothing is per tenant."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

MODEL = "test-model"
KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
SYSTEM = "You are the billing assistant of Acme Corp. Answer in one short sentence. " * 4
ALPHA = {"authorization": "Bearer sk-alpha"}
ONE_USER_TURN = [{"role": "user", "content": "x"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_invoice",
            "description": "Look up an invoice by number.",
            "parameters": {"type": "object", "properties": {"number": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def server(serve, make_engine):
    return serve(make_engine(), model_name=MODEL, api_keys=KEYS, salt_secret="test-secret")


def chat_body(user: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        **extra,
    }


def post(server, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=ALPHA if headers is None else headers, timeout=60)


def cached_by_ids(server, ids: list[int]) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a one-token completion of these token ids."""
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def repeat_cached(server, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """Send ``body`` twice; (prompt tokens, cached tokens of the repeat)."""
    assert post(server, path, body).status_code == 200
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    if "cache_read_input_tokens" in u:  # Anthropic
        total = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        return total, u["cache_read_input_tokens"]
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details")
    return u.get("prompt_tokens", u.get("input_tokens")), details["cached_tokens"]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_a_chat_render_is_the_tokens_the_chat_prefills(server, tools) -> None:
    body = chat_body("Where is invoice 12?", **({"tools": tools} if tools else {}))
    prompt_tokens, cached = repeat_cached(server, "/v1/chat/completions", body)
    r = post(server, "/v1/chat/completions/render", body)
    assert r.status_code == 200, r.text
    out = r.json()
    ids = out["token_ids"]
    assert len(ids) == prompt_tokens and cached > 0
    assert cached_by_ids(server, ids) == (prompt_tokens, cached)  # the same blocks, hit the same way
    assert out["request_id"].startswith("chatcmpl-") and out["model"] == MODEL and out["stream"] is False
    assert out["sampling_params"]["max_tokens"] == 1 and out["sampling_params"]["temperature"] == 0
    assert out["features"] is None and out["cache_salt"] is None
    tokenized = post(server, "/tokenize", {"model": MODEL, "messages": body["messages"], "tools": tools})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == ids and tokenized.json()["count"] == len(ids)


def test_anthropic_and_responses_renders_are_their_generations_tokens(server) -> None:
    messages = {
        "model": MODEL,
        "max_tokens": 1,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "Hello there"}],
    }
    prompt_tokens, cached = repeat_cached(server, "/v1/messages", messages)
    r = post(server, "/v1/messages/render", messages)
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == prompt_tokens
    assert cached_by_ids(server, r.json()["token_ids"]) == (prompt_tokens, cached)

    response = {"model": MODEL, "max_output_tokens": 16, "instructions": SYSTEM, "input": "Hi, it's me again"}
    prompt_tokens, cached = repeat_cached(server, "/v1/responses", response)
    r = post(server, "/v1/responses/render", response)
    assert r.status_code == 200, r.text
    assert r.json()["sampling_params"]["max_tokens"] == 16
    assert cached_by_ids(server, r.json()["token_ids"]) == (prompt_tokens, cached)


def test_completion_render_and_tokenize_agree_with_a_completion(server) -> None:
    text = SYSTEM + "Complete this sentence:"
    body = {"model": MODEL, "prompt": text, "max_tokens": 3, "temperature": 0, "stop": ["."]}
    prompt_tokens, cached = repeat_cached(server, "/v1/completions", body)
    r = post(server, "/v1/completions/render", body)
    assert r.status_code == 200, r.text
    [entry] = r.json()  # a list, one entry per prompt, as vLLM answers
    assert entry["sampling_params"]["stop"] == ["."] and entry["sampling_params"]["max_tokens"] == 3
    assert cached_by_ids(server, entry["token_ids"]) == (prompt_tokens, cached)
    tok = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tok["tokens"] == entry["token_ids"] and tok["max_model_len"] == server.engine.context_len
    assert "".join(tok["token_strs"]) == text  # byte-level tiny tokenizer: one token per byte
    back = post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one"),
        ("/tokenize", {}, 400, "exactly one"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "Unknown model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions/render", {"model": "other", "messages": ONE_USER_TURN}, 404, ""),
        ("/v1/completions/render", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt[1]"),
        ("/v1/messages/render", {"model": MODEL, "messages": ONE_USER_TURN}, 400, "max_tokens"),
        ("/v1/responses/render", {"model": MODEL, "input": "x", "store": True}, 400, "store"),
    ],
)
def test_bad_input_is_a_4xx_that_says_what_to_fix(server, path, body, status, needle) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert needle in message or needle in str(r.json()["error"].get("param"))


@pytest.mark.parametrize(
    "path", ["/tokenize", "/detokenize", "/v1/chat/completions/render", "/v1/messages/render", "/v1/loads"]
)
def test_the_token_routes_and_loads_need_a_key_like_generation(server, path) -> None:
    if path == "/v1/loads":
        r = httpx.get(server.url + path, timeout=10)
    else:
        r = post(server, path, {"prompt": "x"}, headers={})
    assert r.status_code == 401, r.text


def test_engine_probes_answer_in_the_shapes_routers_read(server) -> None:
    version = httpx.get(server.url + "/version").json()
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version["version"])
    info = httpx.get(server.url + "/server_info").json()
    assert info["served_model_name"] == MODEL and info["context_length"] == server.engine.context_len
    assert info["max_running_requests"] == server.engine.max_n and info["page_size"] == 16
    assert httpx.get(server.url + "/get_server_info").json() == info
    model = httpx.get(server.url + "/model_info").json()
    assert model["is_generation"] is True and httpx.get(server.url + "/get_model_info").json() == model
    [entry] = httpx.get(server.url + "/v1/models", headers=ALPHA).json()["data"]
    assert entry["root"] == MODEL and entry["max_model_len"] == server.engine.context_len
    loads = httpx.get(server.url + "/v1/loads?include=core,disagg,queues,memory", headers=ALPHA)
    assert loads.status_code == 200, loads.text
    [rank] = loads.json()["loads"]
    assert rank["num_running_reqs"] == 0 and rank["num_waiting_reqs"] == 0 and rank["token_usage"] == 0.0
    assert httpx.get(server.url + "/v1/loads?include=gpu", headers=ALPHA).status_code == 400
    assert httpx.get(server.url + "/loads?model=other", headers=ALPHA).status_code == 404


def _samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_vllm_gauges_match_the_cache_and_are_the_same_for_every_tenant(server) -> None:
    beta = {"authorization": "Bearer sk-beta"}
    repeat_cached(server, "/v1/chat/completions", chat_body("first"))
    text = httpx.get(server.url + "/metrics").text
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    stats = server.engine.stats()
    assert _samples(text, "vllm:num_requests_running") == {labels: 0.0}
    assert _samples(text, "vllm:num_requests_waiting") == {labels: 0.0}
    assert _samples(text, "vllm:kv_cache_usage_perc") == {labels: stats.bytes / stats.capacity_bytes}
    assert _samples(text, "vllm:prefix_cache_hits_total") == {labels: float(stats.hit_tokens)}
    assert _samples(text, "vllm:prefix_cache_queries_total") == {labels: float(stats.queried_tokens)}
    prompt = _samples(text, "prefixcache_prompt_tokens_total") or {"": 0.0}
    assert _samples(text, "vllm:prompt_tokens_total")[labels] == float(
        re.search(r"^prefixcache_prompt_tokens_total (\S+)$", text, re.M).group(1)
    )
    assert prompt  # (prefixcache's own counter is there beside it)
    a = httpx.get(server.url + "/v1/loads", headers=ALPHA).json()["loads"]
    b = httpx.get(server.url + "/v1/loads", headers=beta).json()["loads"]
    assert a == b and a[0]["token_usage"] == round(stats.bytes / stats.capacity_bytes, 6)
