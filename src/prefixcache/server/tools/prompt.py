"""Tools into the prompt: the tool definitions in one canonical form, the conversation with its
tool calls and results, and the prompt text the engine prefills.

A *conversation* is a list of messages in Hugging Face's tool-use shape, built by
``openai_prompt`` and ``anthropic_prompt`` from either API:

    {"role": "system" | "user", "content": str}
    {"role": "assistant", "content": str, "tool_calls": [ToolCall.as_hf(), ...]}   # tool_calls optional
    {"role": "tool", "tool_call_id": str, "name": str, "content": str, "is_error": bool}  # is_error optional

Two renderings (:class:`PromptRenderer` picks one per request):

- **The model's chat template**, when it renders ``tools`` (``chat_template_supports_tools``):
  tools, calls and results go through ``apply_chat_template(..., tools=...)`` unflattened.
- **The fallback convention** otherwise (one convention, documented in docs/server.md, "Tools"):
  a ``# Tools`` section at the start of the system message lists each tool as one JSON line
  inside ``<tools>...</tools>`` and asks for calls as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an assistant turn's calls are
  rendered in that form after its text; tool results become a user turn of
  ``<tool_response>{"name": ..., "content": ...}</tool_response>`` lines.

Either way the tools come first in the prompt (hosted APIs cache tools, then system, then
messages), and each definition is written by one ``json.dumps`` with fixed separators in the
client's key order, so byte-identical definitions render to identical tokens and a second turn
reads tools + system + history from the cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prefixcache.engine.prompts import chat_template_supports_tools, render_chat_with_tools
from prefixcache.server.errors import bad_request

Message = dict[str, Any]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def dumps(value: Any) -> str:
    """The one JSON writer of everything tool-related in a prompt: the caller's key order,
    fixed separators, no ASCII escaping (same bytes in, same tokens out)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One callable function, whichever API defined it. ``parameters``: its JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def definition(self) -> dict[str, Any]:
        """The OpenAI-style definition both renderings print (the same for both APIs, so one
        tool sent through either API renders to the same tokens)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class ToolChoice(Enum):
    AUTO = "auto"  # the model decides; calls are parsed
    NONE = "none"  # tools stay in the prompt (and the cache); the output is never parsed as calls
    REQUIRED = "required"  # the reply is forced to open with a call
    NAMED = "named"  # the reply is forced to open with a call of one named function


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """A request's tools and how they may be used. ``parallel`` False: at most one call."""

    tools: tuple[FunctionTool, ...] = ()
    choice: ToolChoice = ToolChoice.AUTO
    forced_name: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice is not ToolChoice.NONE

    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)


NO_TOOLS = ToolConfig()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call in the history or in an answer. ``arguments``: the text of a JSON object."""

    id: str
    name: str
    arguments: str

    def arguments_value(self) -> Any:
        """The arguments as an object, or the raw text when it is not a JSON object."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return self.arguments
        return value if isinstance(value, dict) else self.arguments

    def as_hf(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments_value()}
        return {"id": self.id, "type": "function", "function": function}


def assistant_turn(text: str, calls: Sequence[ToolCall] = ()) -> Message:
    turn: Message = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = [c.as_hf() for c in calls]
    return turn


def tool_turn(call_id: str, name: str, content: str, *, is_error: bool = False) -> Message:
    turn: Message = {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
    if is_error:
        turn["is_error"] = True
    return turn


class CallSyntax(Enum):
    TAGGED = "tagged"  # <tool_call>{...}</tool_call> (the fallback; Hermes/Qwen-style templates)
    JSON = "json"  # the whole reply is one JSON object {"name", "arguments" | "parameters"} (Llama-style)


def tools_section(tools: Sequence[FunctionTool]) -> str:
    """The fallback convention's system-prompt section (no trailing newline)."""
    lines = "\n".join(dumps(t.definition()) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the request. The functions, as JSON schemas:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call functions, reply with one <tool_call></tool_call> element per call, each holding a "
        "JSON object with the function's name and arguments:\n"
        '<tool_call>{"name": "<function-name>", "arguments": {"<argument>": "<value>"}}</tool_call>'
    )


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    return (
        TOOL_CALL_OPEN
        + dumps({"name": function["name"], "arguments": function["arguments"]})
        + TOOL_CALL_CLOSE
    )


def _response_text(turn: Message) -> str:
    body: dict[str, Any] = {"name": turn["name"], "content": turn["content"]}
    if turn.get("is_error"):
        body["is_error"] = True
    return TOOL_RESPONSE_OPEN + dumps(body) + TOOL_RESPONSE_CLOSE


def flatten(conversation: Sequence[Message], tools: Sequence[FunctionTool]) -> list[dict[str, str]]:
    """The fallback convention: plain ``{"role", "content": str}`` messages for any chat template.
    Without tools and tool turns, this is the conversation itself."""
    out: list[dict[str, str]] = []
    previous_was_tool = False
    for turn in conversation:
        role = turn["role"]
        if role == "tool":
            piece = _response_text(turn)
            if previous_was_tool:  # consecutive results share one user turn
                out[-1]["content"] += "\n" + piece
            else:
                out.append({"role": "user", "content": piece})
            previous_was_tool = True
            continue
        previous_was_tool = False
        content = str(turn.get("content") or "")
        calls = turn.get("tool_calls") or []
        if calls:
            content = "\n".join(([content] if content else []) + [_call_text(c) for c in calls])
        out.append({"role": role, "content": content})
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            out[0] = {"role": "system", "content": section + ("\n\n" + system if system else "")}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def has_tool_turns(conversation: Sequence[Message]) -> bool:
    return any(t["role"] == "tool" or t.get("tool_calls") for t in conversation)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """What the engine prefills. ``messages``: flat chat messages the engine renders itself
    (the common case); ``text``: the prompt text when the server rendered it (a template with
    tools, or a forced reply start). ``assistant_prefix``: the forced start of the reply, which
    the parser must see before the generated text. ``stop``: extra stop strings."""

    messages: list[dict[str, str]] | None
    text: str | None
    assistant_prefix: str = ""
    syntax: CallSyntax = CallSyntax.TAGGED
    stop: tuple[str, ...] = ()

    def trace_text(self) -> dict[str, Any]:
        """The ``--trace-text`` record: the flat messages, or the prompt text."""
        if self.text is not None:
            return {"prompt": self.text + self.assistant_prefix}
        return {"messages": self.messages}


class PromptRenderer:
    """Renders conversations under one :class:`ToolConfig` for one model.

    ``render_text(messages, add_generation_prompt)`` is the engine's rendering of flat messages
    (``Engine.render``); ``tokenizer`` is asked whether its template renders tools. Rendering
    is pure: call it in a worker thread (a template can take milliseconds).
    """

    def __init__(
        self, config: ToolConfig, tokenizer: Any, render_text: Callable[[list[Any], bool], str]
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.render_text = render_text
        self.template_tools = chat_template_supports_tools(tokenizer)

    def uses_template(self, conversation: Sequence[Message]) -> bool:
        return self.template_tools and (bool(self.config.tools) or has_tool_turns(conversation))

    @property
    def syntax(self) -> CallSyntax:
        template = getattr(self.tokenizer, "chat_template", None)
        if not self.template_tools or TOOL_CALL_OPEN in str(template):
            return CallSyntax.TAGGED
        return CallSyntax.JSON

    def text(
        self,
        conversation: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools_end: int | None = None,
    ) -> str:
        """The prompt text; ``tools_end``: render only the first tools (a cut at a tool's breakpoint)."""
        tools = self.config.tools[:tools_end]
        if self.uses_template(conversation):
            definitions = [t.definition() for t in tools]
            return render_chat_with_tools(
                conversation, definitions, self.tokenizer, add_generation_prompt=add_generation_prompt
            )
        return self.render_text(flatten(conversation, tools), add_generation_prompt)

    def forced_prefix(self) -> str:
        """The start of the reply that ``tool_choice`` required / named forces (no grammar:
        the model continues a call already opened for it)."""
        config = self.config
        if config.choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            return ""
        if self.syntax is not CallSyntax.TAGGED:
            raise bad_request(
                f"tool_choice '{config.choice.value}' needs a <tool_call> chat template; this model's "
                "template writes calls another way: use tool_choice 'auto' or 'none'.",
                param="tool_choice",
            )
        if config.choice is ToolChoice.REQUIRED:
            return TOOL_CALL_OPEN
        return TOOL_CALL_OPEN + '{"name": ' + dumps(config.forced_name) + ', "arguments": '

    def render(self, conversation: Sequence[Message]) -> RenderedPrompt:
        """The request's prompt. Raises APIError 400 for a tool_choice the model cannot honour."""
        prefix = self.forced_prefix()
        stop = (TOOL_CALL_CLOSE,) if self.config.parses_calls and not self.config.parallel else ()
        if self.syntax is not CallSyntax.TAGGED:
            stop = ()  # a JSON reply is one call anyway
        if self.uses_template(conversation) or prefix:
            return RenderedPrompt(None, self.text(conversation), prefix, self.syntax, stop)
        return RenderedPrompt(flatten(conversation, self.config.tools), None, "", self.syntax, stop)


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def tool_config(
    tools: Sequence[FunctionTool],
    choice: ToolChoice | None,
    forced_name: str | None = None,
    parallel: bool | None = None,
    *,
    tools_param: str = "tools",
    tool_path: Callable[[int], str] = lambda i: f"tools[{i}].name",
) -> ToolConfig:
    """A checked :class:`ToolConfig` (400 naming the field otherwise): names of 1-64 letters,
    digits, ``_`` or ``-``, unique; a required or named choice needs tools, a named one a tool
    of that name. ``choice`` None: ``auto``. ``tool_path(i)``: the field of tool ``i``'s name."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not 1 <= len(tool.name) <= 64 or not set(tool.name) <= _NAME_CHARS:
            raise bad_request(
                f"'{tool_path(i)}' must be 1 to 64 letters, digits, '_' or '-'; got '{tool.name[:80]}'.",
                param=tool_path(i),
            )
        if tool.name in seen:
            raise bad_request(
                f"'{tool_path(i)}': the tool name '{tool.name}' is used twice.", param=tool_path(i)
            )
        seen.add(tool.name)
    mode = choice or ToolChoice.AUTO
    if mode in (ToolChoice.REQUIRED, ToolChoice.NAMED) and not tools:
        raise bad_request(
            f"'tool_choice' {mode.value} needs '{tools_param}': send the tools.", param="tool_choice"
        )
    if mode is ToolChoice.NAMED and forced_name not in seen:
        raise bad_request(
            f"'tool_choice' names the tool '{forced_name}', which is not in '{tools_param}'.",
            param="tool_choice",
        )
    return ToolConfig(
        tuple(tools), mode, forced_name if mode is ToolChoice.NAMED else None, parallel is not False
    )


class CallLedger:
    """The calls of a conversation's assistant turns, so a tool result can be checked against
    the call it answers and rendered with its function's name."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def add(self, call: ToolCall) -> ToolCall:
        self._names[call.id] = call.name
        return call

    def name_of(self, call_id: str, param: str) -> str:
        """The called function's name; 400 naming ``param`` when no earlier call has this id."""
        name = self._names.get(call_id)
        if name is None:
            raise bad_request(
                f"'{param}' is '{call_id[:80]}', which answers no tool call earlier in the conversation.",
                param=param,
            )
        return name
