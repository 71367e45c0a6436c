"""Anthropic request -> a conversation (``tool_prompt``'s shape) with its :class:`ToolConfig`,
and ``cache_control`` breakpoints -> a TTL plan ``[(token_end, ttl_s), ...]`` over the rendered
prompt's token positions.

A breakpoint marks the end of a tool definition, of a content block (of the system prompt or of
a message: text, ``tool_use`` or ``tool_result``), of a whole message, or (top-level
``cache_control``) of the prompt. Hosted APIs cache in the order tools, then system, then
messages, and the prompt is rendered in that order. A breakpoint gives every full block up to
it the breakpoint's TTL class; automatic caching of all full blocks applies as well, so a
breakpoint only ever lengthens a TTL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixcache.cache.config import TTL_CLASSES
from prefixcache.server.anthropic.schemas import ANTHROPIC_TTLS, MAX_BREAKPOINTS, CacheControl, PromptFields
from prefixcache.server.errors import bad_request
from prefixcache.server.tools.prompt import (
    CallLedger,
    FunctionTool,
    Message,
    PromptRenderer,
    ToolCall,
    ToolChoice,
    ToolConfig,
    dumps,
    tool_config,
    tool_turn,
)

#: Anthropic ``tool_choice.type`` -> the server's choice.
CHOICES = {
    "auto": ToolChoice.AUTO,
    "any": ToolChoice.REQUIRED,
    "tool": ToolChoice.NAMED,
    "none": ToolChoice.NONE,
}


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """The prompt cut right after a marked block: the conversation up to it (``cut``, its last
    turn holding only what came before the point) rendered with the first ``tools_end`` tools;
    ``whole``: the end of the full prompt."""

    cut: tuple[Message, ...]
    tools_end: int
    ttl_s: float
    whole: bool = False


def _ttl(cc: CacheControl) -> float:
    ttl = cc.ttl or "5m"
    if ttl not in ANTHROPIC_TTLS:  # the schema already refuses these; kept for library callers
        raise bad_request(f"cache_control.ttl must be one of {', '.join(ANTHROPIC_TTLS)}; got '{ttl}'.")
    return TTL_CLASSES[ttl]


def anthropic_tool_config(req: PromptFields) -> ToolConfig:
    """The request's tools (client tools only; 400 naming ``tools[i].type`` for server tools)."""
    tools: list[FunctionTool] = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise bad_request(
                f"'tools[{i}].type' is '{t.type[:40]}': only client tools (name, description, input_schema) "
                "are supported.",
                param=f"tools[{i}].type",
            )
        if t.input_schema is None:
            param = f"tools[{i}].input_schema"
            raise bad_request(f"Missing required parameter '{param}'.", param=param)
        tools.append(FunctionTool(t.name, t.description, t.input_schema))
    choice = req.tool_choice
    if choice is None:
        return tool_config(tools, None)
    if choice.type == "tool" and choice.name is None:
        raise bad_request(
            "Missing required parameter 'tool_choice.name' (tool_choice type 'tool').",
            param="tool_choice.name",
        )
    parallel = not choice.disable_parallel_tool_use
    return tool_config(tools, CHOICES[choice.type], choice.name, parallel)


class _Conversation:
    """Builds the conversation block by block; :meth:`snapshot` is the cut after the last block."""

    def __init__(self) -> None:
        self.turns: list[Message] = []
        self.ledger = CallLedger()

    def open_turn(self, turn: Message) -> Message:
        self.turns.append(turn)
        return turn

    def snapshot(self) -> tuple[Message, ...]:
        if not self.turns:
            return ()
        last = dict(self.turns[-1])
        if "tool_calls" in last:
            last["tool_calls"] = list(last["tool_calls"])
        return (*self.turns[:-1], last)


def to_messages(req: PromptFields) -> tuple[list[Message], list[Breakpoint]]:
    """The conversation (system first, text blocks joined, tool_use blocks as the assistant
    turn's calls, tool_result blocks as tool turns) and the breakpoints."""
    conv = _Conversation()
    breakpoints: list[Breakpoint] = []
    n_tools = len(req.tools or [])
    for i, tool in enumerate(req.tools or []):
        if tool.cache_control is not None:
            breakpoints.append(Breakpoint((), i + 1, _ttl(tool.cache_control)))
    system = req.system_blocks()
    if system:
        turn = conv.open_turn({"role": "system", "content": ""})
        for text_block in system:
            turn["content"] += text_block.text
            if text_block.cache_control is not None:
                breakpoints.append(Breakpoint(conv.snapshot(), n_tools, _ttl(text_block.cache_control)))
    for mi, m in enumerate(req.messages):
        current: Message | None = None  # the turn text and calls of this message go to
        for bi, block in enumerate(m.blocks()):
            where = f"messages[{mi}].content[{bi}]"
            if block.type == "tool_result":
                if m.role != "user":
                    raise bad_request(f"'{where}': tool_result blocks belong in user messages.", param=where)
                name = conv.ledger.name_of(block.tool_use_id, f"{where}.tool_use_id")
                result = tool_turn(block.tool_use_id, name, block.text(), is_error=bool(block.is_error))
                conv.open_turn(result)
                current = None
            else:
                if current is None:
                    current = conv.open_turn({"role": m.role, "content": ""})
                if block.type == "text":
                    current["content"] += block.text
                elif m.role != "assistant":
                    message = f"'{where}': tool_use blocks belong in assistant messages."
                    raise bad_request(message, param=where)
                else:
                    call = conv.ledger.add(ToolCall(block.id, block.name, dumps(block.input)))
                    current.setdefault("tool_calls", []).append(call.as_hf())
            if block.cache_control is not None:
                breakpoints.append(Breakpoint(conv.snapshot(), n_tools, _ttl(block.cache_control)))
        if not m.blocks():
            conv.open_turn({"role": m.role, "content": ""})
        if m.cache_control is not None:
            breakpoints.append(Breakpoint(conv.snapshot(), n_tools, _ttl(m.cache_control)))
    if req.cache_control is not None:
        breakpoints.append(Breakpoint(conv.snapshot(), n_tools, _ttl(req.cache_control), whole=True))
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise bad_request(
            f"A request may have at most {MAX_BREAKPOINTS} cache_control breakpoints; "
            f"it has {len(breakpoints)}. "
            "Remove some (one breakpoint covers everything before it)."
        )
    turns = conv.turns
    if turns and turns[-1]["role"] == "system":
        raise bad_request("'messages' must not be empty: add a user message.", param="messages")
    return turns, breakpoints


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cut_ids(
    renderer: PromptRenderer, tokenize: Callable[[str], list[int]]
) -> Callable[[Sequence[Message], int], list[int]]:
    """``(cut, tools_end) -> ids`` of a cut prompt (no assistant opening). A chat template that
    cannot render the cut (tools and no message) gives no ids: that breakpoint covers nothing
    beyond automatic caching."""

    def render(cut: Sequence[Message], tools_end: int) -> list[int]:
        try:
            return tokenize(renderer.text(list(cut), add_generation_prompt=False, tools_end=tools_end))
        except Exception:  # a template's own error (jinja raise_exception, missing message, ...)
            return []

    return render


def ttl_plan(
    conversation: Sequence[Message],
    breakpoints: Sequence[Breakpoint],
    full_ids: Sequence[int],
    render_cut_ids: Callable[[Sequence[Message], int], Sequence[int]],
    n_tools: int,
) -> list[tuple[int, float]]:
    """Token position of each breakpoint: the common prefix of the full prompt's ids and the ids
    of the prompt cut at the breakpoint (the cut prompt's end-of-turn tokens differ from what
    follows in the full one). Token merges across the cut can only make a position smaller,
    so a breakpoint never covers tokens after it. A cut equal to the whole conversation (or the
    top-level ``cache_control``) covers the whole prompt."""
    plan: list[tuple[int, float]] = []
    whole = list(conversation)
    for bp in breakpoints:
        if bp.whole or (bp.tools_end == n_tools and list(bp.cut) == whole):
            end = len(full_ids)
        else:
            end = common_prefix(full_ids, render_cut_ids(bp.cut, bp.tools_end))
        plan.append((end, bp.ttl_s))
    return plan


def plan_for(
    conversation: list[Message],
    breakpoints: list[Breakpoint],
    full_ids: Sequence[int],
    renderer: PromptRenderer,
    tokenize: Callable[[str], list[int]],
) -> list[tuple[int, float]]:
    """:func:`ttl_plan` with cut prompts rendered like the request's (blocking: a worker thread)."""
    if not breakpoints:
        return []
    render_cut = cut_ids(renderer, tokenize)
    return ttl_plan(conversation, breakpoints, full_ids, render_cut, len(renderer.config.tools))
