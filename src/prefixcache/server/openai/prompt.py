"""OpenAI requests -> a conversation (``tool_prompt``'s shape) and a :class:`ToolConfig`:
chat ``messages`` / ``tools`` / ``tool_choice``, and the Responses API's ``instructions``,
``input`` items and ``tools``.

Every refusal is a 400 that names the field (``messages[2].tool_call_id``, ``input[1].type``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixcache.server.errors import bad_request
from prefixcache.server.openai.schemas import ChatCompletionRequest, ChatMessage
from prefixcache.server.openai.schemas_responses import ResponsesRequest
from prefixcache.server.tools.prompt import (
    CallLedger,
    FunctionTool,
    Message,
    ToolCall,
    ToolChoice,
    ToolConfig,
    assistant_turn,
    tool_config,
    tool_turn,
)

#: Roles as the engine's chat template knows them.
ROLE_MAP = {"developer": "system"}


def chat_conversation(messages: Sequence[ChatMessage]) -> list[Message]:
    """Chat messages as a conversation: assistant ``tool_calls`` and ``role: tool`` results
    (each must answer an earlier call by ``tool_call_id``) included."""
    ledger = CallLedger()
    out: list[Message] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    f"'messages[{i}].tool_call_id' is missing: a tool message answers one call by its id.",
                    param=f"messages[{i}].tool_call_id",
                )
            name = ledger.name_of(m.tool_call_id, f"messages[{i}].tool_call_id")
            out.append(tool_turn(m.tool_call_id, name, m.text()))
        elif m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    f"'messages[{i}].tool_calls' is only allowed on assistant messages.",
                    param=f"messages[{i}].tool_calls",
                )
            calls = [ledger.add(ToolCall(c.id, c.function.name, c.function.arguments)) for c in m.tool_calls]
            out.append(assistant_turn(m.text(), calls))
        else:
            out.append({"role": ROLE_MAP.get(m.role, m.role), "content": m.text()})
    return out


def _choice(raw: Any) -> tuple[ToolChoice | None, str | None]:
    """``tool_choice`` of either OpenAI API: a mode string or a named function."""
    if raw is None:
        return None, None
    if isinstance(raw, str):
        return ToolChoice(raw), None
    name = raw.function.name if hasattr(raw, "function") else raw.name
    return ToolChoice.NAMED, name


def chat_tool_config(body: ChatCompletionRequest) -> ToolConfig:
    tools: list[FunctionTool] = []
    for i, t in enumerate(body.tools or []):
        if t.type != "function" or t.function is None:
            raise bad_request(
                f"'tools[{i}].type' is '{t.type[:40]}': only function tools "
                '({"type": "function", "function": {...}}) are supported.',
                param=f"tools[{i}].type",
            )
        tools.append(FunctionTool(t.function.name, t.function.description, t.function.parameters))
    choice, name = _choice(body.tool_choice)
    return tool_config(
        tools, choice, name, body.parallel_tool_calls, tool_path=lambda i: f"tools[{i}].function.name"
    )


def responses_tool_config(body: ResponsesRequest) -> ToolConfig:
    tools: list[FunctionTool] = []
    for i, t in enumerate(body.tools or []):
        if t.type != "function":
            raise bad_request(
                f"'tools[{i}].type' is '{t.type[:40]}': only function tools are supported.",
                param=f"tools[{i}].type",
            )
        if t.name is None:
            raise bad_request(f"Missing required parameter 'tools[{i}].name'.", param=f"tools[{i}].name")
        tools.append(FunctionTool(t.name, t.description, t.parameters))
    choice, name = _choice(body.tool_choice)
    return tool_config(tools, choice, name, body.parallel_tool_calls)


# ---------------------------------------------------------------------------- Responses input

_TEXT_PARTS = ("input_text", "output_text", "text")


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        kind = "missing" if value is None else f"a {type(value).__name__}"
        raise bad_request(f"'{where}.{key}' must be a string; it is {kind}.", param=f"{where}.{key}")
    return value


def _content_text(content: Any, where: str) -> str:
    """A string, or text parts (``input_text`` / ``output_text``) joined; other parts refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts.", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"'{where}[{j}].type' is '{str(kind)[:40]}': only text parts (input_text, output_text) "
                "are supported.",
                param=f"{where}[{j}].type",
            )
        parts.append(part["text"])
    return "".join(parts)


def responses_conversation(instructions: str | None, items: str | list[dict[str, Any]]) -> list[Message]:
    """``instructions`` (a system turn first) and ``input`` as a conversation. Items: messages
    (``role`` user / system / developer / assistant), ``function_call`` (joins the assistant
    turn before it) and ``function_call_output`` (must answer an earlier ``call_id``)."""
    out: list[Message] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        if not items:
            raise bad_request("'input' is empty: send the user's text or a list of items.", param="input")
        return [*out, {"role": "user", "content": items}]
    if not items:
        raise bad_request("'input' is empty: send the user's text or a list of items.", param="input")
    ledger = CallLedger()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"'{where}.role' must be user, system, developer or assistant; got '{str(role)[:40]}'.",
                    param=f"{where}.role",
                )
            out.append(
                {
                    "role": ROLE_MAP.get(role, role),
                    "content": _content_text(item.get("content"), f"{where}.content"),
                }
            )
        elif kind == "function_call":
            call = ledger.add(
                ToolCall(
                    _str_field(item, "call_id", where),
                    _str_field(item, "name", where),
                    _str_field(item, "arguments", where),
                )
            )
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call.as_hf())
            else:
                out.append(assistant_turn("", [call]))
        elif kind == "function_call_output":
            call_id = _str_field(item, "call_id", where)
            name = ledger.name_of(call_id, f"{where}.call_id")
            out.append(tool_turn(call_id, name, _content_text(item.get("output"), f"{where}.output")))
        else:
            raise bad_request(
                f"'{where}.type' is '{str(kind)[:40]}': supported input items are message, function_call and "
                "function_call_output (this server keeps no items to reference).",
                param=f"{where}.type",
            )
    return out
