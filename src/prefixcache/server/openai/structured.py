"""Structured output's request fields, turned into a compiled grammar (``engine/serving/guided.py``).

- Chat and completions: ``response_format`` (``json_object``; ``json_schema`` with its ``schema``);
  vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``) and its older
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.
- Responses: ``text.format`` (``json_object``; ``json_schema`` with ``schema`` beside ``name``).

The schema is not added to the prompt: where the API puts it in the prompt (the caller's own
messages), it is there; otherwise the grammar alone shapes the answer, so a prompt with and
without a schema shares its cached blocks. Compiled grammars are cached per schema by the engine.
"""

from __future__ import annotations

import json
from typing import Any

from prefixcache.server.errors import APIError, bad_request

#: vLLM's structured_outputs keys -> the engine's grammar kinds.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            message = f"'{param}' is not valid JSON: send a JSON Schema object."
            raise bad_request(message, param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON Schema object.", param=param)
    return value


def _response_format(fmt: dict[str, Any], param: str, schema_key: str | None) -> tuple[str, Any, str] | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ("json", None, param)
    if kind == "json_schema":
        holder = fmt.get(schema_key) if schema_key else fmt
        where = f"{param}.{schema_key}.schema" if schema_key else f"{param}.schema"
        if not isinstance(holder, dict) or "schema" not in holder:
            raise bad_request(f"'{where}' is missing: a json_schema format needs its schema.", param=where)
        return ("json_schema", _schema(holder["schema"], where), where)
    message = f"'{param}.type' is '{str(kind)[:40]}': use 'text', 'json_object' or 'json_schema'."
    raise bad_request(message, param=f"{param}.type")


def requested_grammar(body: Any) -> tuple[str, Any, str] | None:
    """(kind, spec, param) of a chat or completions request's structured output, or None."""
    asks: list[tuple[str, Any, str]] = []
    if body.response_format is not None:
        got = _response_format(body.response_format, "response_format", "json_schema")
        if got is not None:
            asks.append(got)
    so = body.structured_outputs or {}
    for key, kind in _VLLM_KINDS.items():
        if so.get(key) is not None:
            spec = _schema(so[key], f"structured_outputs.{key}") if key == "json" else so[key]
            asks.append((kind, spec, f"structured_outputs.{key}"))
    if so.get("json_object"):
        asks.append(("json", None, "structured_outputs.json_object"))
    for field, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "lark"),
    ):
        value = getattr(body, field)
        if value is not None:
            asks.append((kind, _schema(value, field) if field == "guided_json" else value, field))
    if len(asks) > 1:
        names = ", ".join(f"'{p}'" for _, _, p in asks)
        raise bad_request(f"Ask for one structured output at a time; got {names}.", param=asks[1][2])
    return asks[0] if asks else None


def responses_grammar(text: Any) -> tuple[str, Any, str] | None:
    """(kind, spec, param) of a Responses request's ``text.format``, or None."""
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return None
    return _response_format(text["format"], "text.format", None)


async def compile_grammar(bridge: Any, ask: tuple[str, Any, str] | None) -> Any:
    """The engine's compiled grammar for ``ask`` (in a worker thread), or None; a 400 naming the
    field when it cannot be compiled. A forced tool call's grammar (param ``tool_choice``) is
    best effort: None where the engine has no grammar support."""
    if ask is None:
        return None
    kind, spec, param = ask
    engine = bridge.engine
    if getattr(engine, "grammars", None) is None:
        if param == "tool_choice":
            return None
        raise bad_request(f"'{param}': structured output is not available on this engine.", param=param)
    try:
        return await bridge.run(lambda: engine.grammars.compile(kind, spec))
    except APIError as exc:
        raise bad_request(f"'{param}': {exc.message}", param=param) from exc


def forced_tool_grammar(config: Any) -> tuple[str, Any, str] | None:
    """A forced call's arguments held to its tool's schema: ``tool_choice`` naming a function
    (OpenAI) or ``{"type": "tool", "name": ...}`` (Anthropic). The prompt already ends in
    ``<tool_call>{"name": ..., "arguments": `` (the forced prefix), so the grammar is the
    arguments' JSON, the call's closing brace and the closing tag. None for any other choice."""
    from prefixcache.server.tools.prompt import TOOL_CALL_CLOSE, ToolChoice

    if config.choice is not ToolChoice.NAMED:
        return None
    tool = next((t for t in config.tools if t.name == config.forced_name), None)
    if tool is None:
        return None
    schema = dict(tool.parameters or {"type": "object"})
    schema.setdefault("x-guidance", {"whitespace_flexible": False})
    lark = f'start: args "}}" {json.dumps(TOOL_CALL_CLOSE)}\nargs: %json {json.dumps(schema)}'
    return ("lark", lark, "tool_choice")
