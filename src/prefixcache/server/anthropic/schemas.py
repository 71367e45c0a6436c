"""Request bodies of the Anthropic-compatible routes (pydantic; the OpenAPI schema comes from here)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

#: A breakpoint's ``ttl`` -> seconds (``prefixcache.cache.config.TTL_CLASSES``).
ANTHROPIC_TTLS = ("5m", "1h")
MAX_BREAKPOINTS = 4


class CacheControl(BaseModel):
    """``{"type": "ephemeral", "ttl": "5m" | "1h"}``: cache everything up to here with that TTL."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    """A user message's answer to the call ``tool_use_id``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Tool(BaseModel):
    """A client tool. Server tools (a ``type`` such as ``bash_20250124``) are refused by name."""

    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    type: StrictStr | None = None
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = Field(
        None, description="A breakpoint after this tool (tools come first)."
    )


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]
    cache_control: CacheControl | None = Field(
        None, description="Extension: a breakpoint after the whole message."
    )

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class PromptFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    cache_control: CacheControl | None = Field(
        None, description="Automatic caching: a breakpoint at the end of the prompt."
    )
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None

    def system_blocks(self) -> list[TextBlock]:
        if self.system is None:
            return []
        if isinstance(self.system, str):
            return [TextBlock(type="text", text=self.system)] if self.system else []
        return list(self.system)


class DiagnosticsParam(BaseModel):
    """Cache diagnostics (see ``prefixcache.server.ops.diagnostics``): the previous answer's id, or
    null on the first turn."""

    model_config = ConfigDict(extra="ignore")
    previous_message_id: Annotated[StrictStr, Field(max_length=200)] | None = None


class MessagesRequest(PromptFields):
    """POST /v1/messages."""

    max_tokens: Annotated[StrictInt, Field(ge=1, le=1_000_000)]
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_sequences: Annotated[list[StrictStr], Field(max_length=8)] | None = None
    stream: StrictBool | None = False
    metadata: dict[str, Any] | None = None
    diagnostics: DiagnosticsParam | None = Field(
        None, description="Cache diagnostics: compare with the answer named by previous_message_id."
    )


class CountTokensRequest(PromptFields):
    """POST /v1/messages/count_tokens."""
