"""What the router reads and writes in the bodies it relays: usage, event boundaries, errors.

* :func:`usage_from` and :class:`SSEUsage`: (prompt, cached) tokens from an answer or a stream.
* :class:`EventCutter`: cuts relayed stream bytes at server-sent-event boundaries, so that the
  client only ever holds whole events and a broken stream can end with a whole error event.
* :func:`error_body` and :func:`stream_error_event`: the router's own errors in the shape of the
  API the client called (OpenAI, OpenAI Responses, or Anthropic under ``/v1/messages``).
"""

from __future__ import annotations

import json
from typing import Any

#: A held-back partial event larger than this is relayed anyway (a stream without boundaries).
MAX_PENDING_BYTES = 1 << 20

_ANTHROPIC_TYPES = {400: "invalid_request_error", 413: "request_too_large"}
_OPENAI_TYPES = {400: "invalid_request_error", 413: "invalid_request_error"}


def usage_from(obj: Any) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from an OpenAI chat/completions, OpenAI Responses or
    Anthropic response, or from one of their stream events."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    for wrapper in ("message", "response"):  # Anthropic message_start; Responses stream events
        if not isinstance(usage, dict) and isinstance(obj.get(wrapper), dict):
            usage = obj[wrapper].get("usage")
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details") or {}
        return usage["prompt_tokens"], int(details.get("cached_tokens") or 0)
    if not isinstance(usage.get("input_tokens"), int):
        return None
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # Responses: input_tokens is the whole prompt
        return usage["input_tokens"], int(details.get("cached_tokens") or 0)
    read = int(usage.get("cache_read_input_tokens") or 0)  # Anthropic: input_tokens is the rest
    created = int(usage.get("cache_creation_input_tokens") or 0)
    return usage["input_tokens"] + read + created, read


class SSEUsage:
    """Finds the usage in a server-sent-event stream fed in arbitrary byte chunks."""

    def __init__(self) -> None:
        self._buf = b""
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:") and b"usage" in line:
                try:
                    found = usage_from(json.loads(line[5:]))
                except ValueError:
                    continue
                if found is not None and (self.usage is None or found[0] >= self.usage[0]):
                    self.usage = found  # Anthropic repeats usage in message_delta; keep the fullest


class EventCutter:
    """Holds back the partial event at the end of the bytes fed so far.

    ``feed(data)`` returns the bytes up to the last event boundary (a blank line) seen, keeping
    the rest; ``rest()`` returns what is held at a clean end. ``at_boundary``: everything
    returned so far ends with a whole event (true unless :data:`MAX_PENDING_BYTES` forced a cut).
    """

    def __init__(self) -> None:
        self._pending = b""
        self.at_boundary = True

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        cut = max(self._pending.rfind(b"\n\n") + 2, self._pending.rfind(b"\r\n\r\n") + 4, 0)
        if cut < 2 and len(self._pending) > MAX_PENDING_BYTES:
            cut = len(self._pending)
            self.at_boundary = False
        elif cut >= 2:
            self.at_boundary = True
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def rest(self) -> bytes:
        out, self._pending = self._pending, b""
        return out


def api_of(path: str) -> str:
    """``"anthropic"``, ``"responses"`` or ``"openai"``: whose error shapes ``path`` speaks."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "responses" if path.startswith("/v1/responses") else "openai"


def error_body(status: int, message: str, path: str, code: str) -> dict[str, Any]:
    """A router error as the API of ``path`` writes errors."""
    if api_of(path) == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def stream_error_event(path: str, message: str, code: str) -> bytes:
    """The event that ends a broken stream, as the API of ``path`` writes a stream error (the
    OpenAI and Anthropic clients raise on it rather than end quietly)."""
    api = api_of(path)
    if api == "anthropic":
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    if api == "responses":
        data = {"type": "error", "code": code, "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    data = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(data)}\n\n".encode()
