"""Hypothesis strategies for the server's request bodies: every route's schema, each field either
a valid value or an edge case (lone surrogates, NUL, special-token strings, very long strings,
extreme and non-finite numbers, wrong types, deep nesting), plus raw bodies that are not JSON.

A body is generated as a Python value and encoded by :func:`encode`, which writes lone
surrogates as ``\\udXXX`` escapes (what an attacker sends) and splices :class:`Deep` values in as
raw text, nested far beyond what ``json.dumps`` could write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

MODEL = "test-model"
#: Valid ``max_tokens``: small, so that a valid example decodes in milliseconds on the tiny model.
SMALL_MAX_TOKENS = st.integers(1, 8)


@dataclass(frozen=True)
class Deep:
    """``depth`` levels of ``[`` (or ``{"a":``) around ``0``, written raw by :func:`encode`."""

    depth: int
    objects: bool = False

    def text(self) -> str:
        if self.objects:
            return '{"a":' * self.depth + "0" + "}" * self.depth
        return "[" * self.depth + "0" + "]" * self.depth


LONE_SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
EDGE_STRINGS = st.sampled_from(
    [
        "",
        "\x00",
        "a\x00b",
        "\ud800",
        "x\udfffy",
        "\ud83d",
        "\ude00\ud83d",
        "\\ud800",
        "\ufeff",
        "\u202e",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "{{ raise }}",
        "{% for %}",
        "\U0001f642",
        "\r\n",
        "\t" * 10,
    ]
)
LONG_STRINGS = st.builds(
    lambda c, n: c * n,
    st.sampled_from(["a", "[", "{", '"', "\\", " ", "\n", "\u00e9", "\U0001f642"]),
    st.sampled_from([1_000, 5_000, 40_000, 300_000]),
)
PLAIN_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
TEXT = st.one_of(
    PLAIN_TEXT,
    PLAIN_TEXT,
    PLAIN_TEXT,
    PLAIN_TEXT,
    PLAIN_TEXT,
    PLAIN_TEXT,
    st.text(st.characters(codec=None), max_size=20),  # surrogates and every other code point
    EDGE_STRINGS,
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), LONE_SURROGATES, st.text(max_size=5)),
    LONG_STRINGS,
)
EXTREME_NUMBERS = st.one_of(
    st.sampled_from(
        [
            0,
            -1,
            1,
            2,
            2**31,
            2**53 + 1,
            2**63 - 1,
            2**63,
            2**64 - 1,
            2**64,
            -(2**63) - 1,
            10**40,
            -(10**40),
            10**400,
        ]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-40, 5e-324, -0.0, 1e308, 1e-5, 0.5, 2.0000001]),
    st.floats(min_value=0, max_value=1e-30, exclude_min=True),  # positive, far below float32's range
)
DEEP = st.builds(Deep, st.sampled_from([2, 63, 64, 65, 200, 5_000, 200_000]), st.booleans())
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_NUMBERS, TEXT)
ANY_VALUE = st.recursive(
    SCALARS | DEEP,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value (7 in 8), sometimes anything at all."""
    return st.one_of(*[valid] * 7, ANY_VALUE)


def body(
    required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Any]:
    """An object with the required fields (each sometimes left out or mangled) and some optional ones."""
    fields = {k: field(v) for k, v in required.items()}
    keep = st.fixed_dictionaries(fields, optional={k: field(v) for k, v in optional.items()})
    drop_one = st.fixed_dictionaries({}, optional=fields)
    extra = st.dictionaries(TEXT, ANY_VALUE, max_size=2)
    full = st.builds(lambda d, e: {**e, **d}, keep, st.just({}) | extra)
    return st.one_of(full, full, full, full, full, full, drop_one, ANY_VALUE)  # ANY_VALUE: not an object


ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
TEXT_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True) | TEXT},
            optional={"description": TEXT, "parameters": st.just({"type": "object"}) | ANY_VALUE},
        ),
    }
)
CHAT_MESSAGE = st.fixed_dictionaries(
    {"role": ROLES, "content": TEXT | TEXT_PARTS},
    optional={
        "name": TEXT,
        "tool_call_id": TEXT,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": TEXT,
                    "type": st.just("function"),
                    "function": (st.fixed_dictionaries({"name": TEXT, "arguments": TEXT})),
                }
            ),
            max_size=2,
        ),
    },
)
SAMPLING = {  # the numbers: as often an edge case as a valid value
    "temperature": st.floats(0, 2) | EXTREME_NUMBERS,
    "top_p": st.floats(0, 1) | EXTREME_NUMBERS,
    "top_k": st.integers(0, 50),
    "seed": st.integers() | EXTREME_NUMBERS,
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stop": TEXT | st.lists(TEXT, max_size=5),
    "user": TEXT,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "prompt_cache_key": TEXT,
    "prompt_cache_retention": st.sampled_from(["in_memory", "24h", "1h"]),
}

CHAT = body(
    {"model": st.just(MODEL), "messages": st.lists(CHAT_MESSAGE, min_size=1, max_size=3)},
    {
        **SAMPLING,
        "max_tokens": SMALL_MAX_TOKENS,
        "max_completion_tokens": SMALL_MAX_TOKENS,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "tools": st.lists(TOOL, max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required"]),
        "parallel_tool_calls": st.booleans(),
    },
)
COMPLETIONS = body(
    {
        "model": st.just(MODEL),
        "prompt": TEXT
        | st.lists(TEXT, min_size=1, max_size=1)
        | st.lists(st.integers(0, 600) | EXTREME_NUMBERS, min_size=1, max_size=20),
    },
    {
        **SAMPLING,
        "max_tokens": SMALL_MAX_TOKENS,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 5),
        "suffix": TEXT,
        "best_of": st.integers(1, 3),
    },
)
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("text"), "text": TEXT},
        optional={
            "cache_control": st.fixed_dictionaries(
                {"type": st.just("ephemeral")}, optional={"ttl": st.sampled_from(["5m", "1h", "2h"])}
            )
        },
    ),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT, "input": ANY_VALUE}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT, "content": TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking"])}),
)
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]), "content": TEXT | st.lists(ANTHROPIC_BLOCK, max_size=3)}
)
ANTHROPIC_PROMPT = {"model": st.just(MODEL), "messages": st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=3)}
ANTHROPIC_OPTIONAL = {
    "system": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
    "tools": st.lists(st.fixed_dictionaries({"name": TEXT, "input_schema": ANY_VALUE}), max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none"])}, optional={"name": TEXT}
    ),
    "cache_control": st.fixed_dictionaries({"type": st.just("ephemeral")}),
}
MESSAGES = body(
    {**ANTHROPIC_PROMPT, "max_tokens": SMALL_MAX_TOKENS},
    {
        **ANTHROPIC_OPTIONAL,
        "temperature": st.floats(0, 1) | EXTREME_NUMBERS,
        "top_p": st.floats(0, 1),
        "top_k": st.integers(0, 50),
        "stop_sequences": st.lists(TEXT, max_size=3),
        "stream": st.booleans(),
        "metadata": st.dictionaries(TEXT, ANY_VALUE, max_size=2),
    },
)
COUNT_TOKENS = body(ANTHROPIC_PROMPT, ANTHROPIC_OPTIONAL)
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "developer", "assistant"]),
            "content": TEXT
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT}
                ),
                max_size=2,
            ),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": TEXT, "name": TEXT, "arguments": TEXT}
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}),
    st.fixed_dictionaries({"type": TEXT}),
)
RESPONSES = body(
    {"model": st.just(MODEL), "input": TEXT | st.lists(RESPONSES_ITEM, max_size=3)},
    {
        "instructions": TEXT,
        "max_output_tokens": SMALL_MAX_TOKENS,
        "temperature": st.floats(0, 2),
        "stream": st.booleans(),
        "store": st.booleans(),
        "previous_response_id": TEXT,
        "reasoning": ANY_VALUE,
        "text": ANY_VALUE,
        "include": st.lists(TEXT, max_size=2),
        "truncation": st.sampled_from(["auto", "disabled"]),
        "tools": st.lists(
            st.fixed_dictionaries({"type": st.just("function"), "name": TEXT, "parameters": ANY_VALUE}),
            max_size=2,
        ),
        "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
        "prompt_cache_retention": st.just("24h"),
    },
)
PIN_SOURCES = {
    "messages": st.lists(CHAT_MESSAGE, min_size=1, max_size=2),
    "prompt": TEXT,
    "prompt_token_ids": st.lists(st.integers(0, 600) | EXTREME_NUMBERS, min_size=1, max_size=40),
}
PIN = st.one_of(*[body({k: v}, {}) for k, v in PIN_SOURCES.items()], body({}, PIN_SOURCES))

TOKENIZE = st.one_of(
    body({"prompt": TEXT}, {"model": st.just(MODEL), "add_special_tokens": st.booleans()}),
    body(
        {"messages": st.lists(CHAT_MESSAGE, min_size=1, max_size=3)},
        {
            "model": st.just(MODEL),
            "tools": st.lists(TOOL, max_size=2),
            "tool_choice": st.sampled_from(["none", "auto", "required"]),
            "add_generation_prompt": st.booleans(),
            "return_token_strs": st.booleans(),
        },
    ),
)
DETOKENIZE = body(
    {"tokens": st.lists(st.integers(0, 600) | EXTREME_NUMBERS, max_size=40)}, {"model": st.just(MODEL)}
)

#: (method, path) -> body strategy, for every route that takes a body (``test_server_fuzz``
#: checks this against the app's routes).
BODIES: dict[tuple[str, str], st.SearchStrategy[Any]] = {
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/v1/completions"): COMPLETIONS,
    ("POST", "/v1/responses"): RESPONSES,
    ("POST", "/v1/messages"): MESSAGES,
    ("POST", "/v1/messages/count_tokens"): COUNT_TOKENS,
    ("POST", "/v1/cache/pin"): PIN,
    ("DELETE", "/v1/cache/pin"): PIN,
    ("POST", "/v1/cache/verify"): PIN,
    ("POST", "/tokenize"): TOKENIZE,
    ("POST", "/detokenize"): DETOKENIZE,
    ("POST", "/v1/chat/completions/render"): CHAT,
    ("POST", "/v1/completions/render"): COMPLETIONS,
    ("POST", "/v1/messages/render"): MESSAGES,
    ("POST", "/v1/responses/render"): RESPONSES,
}
#: Routes without a body (every other route of the app, and two it does not have); fuzzed with
#: junk headers, queries and bodies.
BODILESS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/cache"),
    ("DELETE", "/v1/cache"),
    ("GET", "/v1/cache/report"),
    ("GET", "/v1/cache/verify"),
    ("POST", "/v1/cache/verify/ack"),
    ("GET", "/v1/dashboard"),
    ("GET", "/version"),
    ("GET", "/server_info"),
    ("GET", "/get_server_info"),
    ("GET", "/model_info"),
    ("GET", "/get_model_info"),
    ("GET", "/loads"),
    ("GET", "/get_loads"),
    ("GET", "/v1/loads"),
    ("GET", "/v1/nowhere"),
    ("PUT", "/v1/chat/completions"),
]

#: Bodies built to make a JSON scanner backtrack or recurse: brackets past the depth limit's
#: pre-check, then an unterminated string of escape runs (``\\"`` repeated: the quadratic case of
#: a string regex), a lone quote, a run of backslashes, or more nesting; after a valid prefix or
#: bare. Up to 512 KiB, so that a scan that is not linear times the request out.
HOSTILE_BODIES = st.builds(
    lambda prefix, opener, unit, n: prefix + opener + unit * n,
    st.sampled_from([b"", b'{"model":"test-model","messages":[{"role":"user","content":', b'{"prompt":']),
    st.sampled_from([b"[" * 65, b'{"a":' * 65, b"[" * 65 + b'"', b'["', b"[" * 64 + b'{"x":"']),
    st.sampled_from([b'\\"', b"\\", b'"', b'\\\\"[', b"[", b'{"a":', b'"[', b"\\u00"]),
    st.sampled_from([1, 1_000, 40_000, 170_000]),
)

RAW_BODIES = st.one_of(
    st.binary(max_size=200),
    HOSTILE_BODIES,
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b"\xff\xfe{}",
            b"\xef\xbb\xbf{}",
            b'{"a":1,"a":2}',
            b'{"model":"test-model","messages":[{"role":"user","content":"\xed\xa0\x80"}]}',
            b'{"model": NaN}',
            b'{"model":"test-model","max_tokens":1e999}',
            b"{" * 100_000,
        ]
    ),
    st.builds(lambda d: d.text().encode(), DEEP),
)


def encode(value: Any) -> bytes:
    """JSON bytes of ``value``: lone surrogates as escapes, :class:`Deep` spliced in raw."""
    deep: list[Deep] = []

    def hole(obj: Any) -> str:
        if isinstance(obj, Deep):
            deep.append(obj)
            return f"\x00DEEP{len(deep) - 1}\x00"
        raise TypeError(type(obj).__name__)

    text = json.dumps(value, default=hole)  # ensure_ascii: \\ud800 escapes, \\u0000 for NUL
    for i, d in enumerate(deep):
        text = text.replace(json.dumps(f"\x00DEEP{i}\x00"), d.text(), 1)
    return text.encode()
