"""Tool calls out of the model's reply: a tolerant parser and its streaming form.

    out = parse_tool_calls(reply, names={"get_weather"})      # ParsedReply(text, calls)
    splitter = ToolCallSplitter(names, prefix="")              # streaming
    for delta in deltas: send(splitter.push(delta))            # text that is certainly not a call
    out = splitter.finish(); send(out.text[splitter.sent:])    # the rest, then out.calls

Only well-formed calls become calls: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``
(:attr:`CallSyntax.TAGGED`; ``"parameters"`` is accepted for ``"arguments"``, arguments given as
a JSON string holding an object are accepted, absent arguments are ``{}``) where ``N`` is a
tool of the request. A missing closing tag is accepted only at the very end of the reply (a
stop string may have cut it). Everything else stays text: malformed JSON, an unknown name, a
stray tag. Whitespace that only separates text from a call is dropped; a reply without calls
is returned unchanged. With :attr:`CallSyntax.JSON` (Llama-style templates) the whole reply
must be one such JSON object (or a list of them) to be a call.

The splitter gives the same text as the parser: it sends text up to the first possible call
opening (holding back trailing whitespace and a partial ``<tool_call>``), buffers from there,
and at the end parses the whole reply, so streamed text + :meth:`finish`'s rest equals
``parse_tool_calls(reply).text``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from prefixcache.limits import MAX_JSON_DEPTH, json_depth
from prefixcache.server.tools.prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, CallSyntax, dumps

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A call the model made. ``arguments``: the text of a JSON object (written by ``dumps``)."""

    name: str
    arguments: str


@dataclass(slots=True)
class ParsedReply:
    text: str
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id(prefix: str) -> str:
    """``call_...`` (OpenAI), ``toolu_...`` (Anthropic), ``fc_...`` (a Responses item)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def call_from_json(value: Any, names: Collection[str]) -> ParsedCall | None:
    """A call from a decoded JSON value, or None unless it is a well-formed call of a known tool."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    if set(value) - {"name", "arguments", "parameters"}:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        if _too_deep(arguments):
            return None
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], dumps(arguments))


def _too_deep(text: str) -> bool:
    """Whether ``text`` nests JSON deeper than any tool call's arguments may (a model's output of
    a thousand brackets must be text, not a RecursionError in the decoder or encoder)."""
    return ("[" in text or "{" in text) and json_depth(text.encode("utf-8", "surrogatepass")) > MAX_JSON_DEPTH


def _decode_whole(body: str) -> tuple[bool, Any]:
    """(True, value) when ``body`` is exactly one JSON value, surrounded by whitespace at most."""
    text = body.strip()
    if _too_deep(text):
        return False, None
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return False, None
    return end == len(text), value


def _parse_tagged(reply: str, names: Collection[str]) -> ParsedReply:
    segments: list[str] = []  # text between calls; segments[i] precedes calls[i]
    calls: list[ParsedCall] = []
    text_start = 0  # start of the current text segment
    pos = 0
    while (start := reply.find(TOOL_CALL_OPEN, pos)) >= 0:
        body_start = start + len(TOOL_CALL_OPEN)
        close = reply.find(TOOL_CALL_CLOSE, body_start)
        body_end = len(reply) if close < 0 else close
        if TOOL_CALL_OPEN in reply[body_start:body_end]:  # a stray opening: stays text
            pos = body_start
            continue
        whole, value = _decode_whole(reply[body_start:body_end])
        call = call_from_json(value, names) if whole else None
        if call is None:
            pos = body_start
            continue
        segments.append(reply[text_start:start])
        calls.append(call)
        text_start = pos = len(reply) if close < 0 else close + len(TOOL_CALL_CLOSE)
    if not calls:
        return ParsedReply(reply)
    segments.append(reply[text_start:])
    parts = []
    for i, segment in enumerate(segments):
        if i < len(calls):
            segment = segment.rstrip()
        if i > 0:
            segment = segment.lstrip()
        parts.append(segment)
    return ParsedReply("".join(parts), calls)


def _parse_json(reply: str, names: Collection[str]) -> ParsedReply:
    whole, value = _decode_whole(reply)
    values = value if isinstance(value, list) else [value]
    calls = [call_from_json(v, names) for v in values] if whole and values else [None]
    if any(c is None for c in calls):
        return ParsedReply(reply)
    return ParsedReply("", [c for c in calls if c is not None])


def parse_tool_calls(
    reply: str, names: Collection[str], syntax: CallSyntax = CallSyntax.TAGGED
) -> ParsedReply:
    """The reply's text and its well-formed calls of the tools ``names`` (see the module doc)."""
    if syntax is CallSyntax.JSON:
        return _parse_json(reply, names)
    return _parse_tagged(reply, names)


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallSplitter:
    """Streaming :func:`parse_tool_calls`. ``prefix``: the forced start of the reply (it counts
    as reply text, and opens a call at once). ``sent``: characters of the reply already
    returned by :meth:`push`."""

    def __init__(
        self, names: Collection[str], syntax: CallSyntax = CallSyntax.TAGGED, prefix: str = ""
    ) -> None:
        self.names = names
        self.syntax = syntax
        self.reply = prefix
        self.sent = 0
        self.opened = False

    def push(self, delta: str) -> str:
        """Append a text delta; return the text now known not to belong to a call ("" often)."""
        self.reply += delta
        if self.opened:
            return ""
        rest = self.reply[self.sent :]
        if self.syntax is CallSyntax.JSON:
            # The whole reply is either one call or text: hold it while it could start a call.
            if not self.reply.strip() or self.reply.lstrip().startswith(("{", "[")):
                self.opened = bool(self.reply.strip())
                return ""
            safe = len(rest)
        else:
            found = rest.find(TOOL_CALL_OPEN)
            self.opened = found >= 0
            safe = found if found >= 0 else len(rest) - _partial_open_len(rest)
        safe = len(rest[:safe].rstrip())  # whitespace before a call is not sent
        self.sent += safe
        return rest[:safe]

    def finish(self) -> ParsedReply:
        """Parse the whole reply. Its ``text`` starts with everything :meth:`push` returned;
        send ``text[self.sent:]`` next, then the calls."""
        parsed = parse_tool_calls(self.reply, self.names, self.syntax)
        assert parsed.text.startswith(self.reply[: self.sent]), "sent text is always a prefix of the parse"
        return parsed
