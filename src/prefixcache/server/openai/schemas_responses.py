"""Request body of POST /v1/responses (pydantic; the OpenAPI schema comes from here).

``input`` items are checked by hand in ``openai_prompt.responses_conversation`` so that every
refusal names its item (``input[3].type``). Fields this server cannot honour are declared here
only so that the route can refuse them by name (see ``routes_responses.refuse_unsupported``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from prefixcache.server.openai.schemas import CachedGeneration, MaxTokens


class ResponsesTool(BaseModel):
    """``{"type": "function", "name", "description", "parameters", "strict"}``; other types
    (web_search, file_search, mcp, ...) are refused by name."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    name: StrictStr | None = None
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = Field(
        None, description="Accepted; the schema is not enforced while decoding."
    )


class ResponsesNamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: StrictStr


class ResponsesRequest(CachedGeneration):
    """POST /v1/responses."""

    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: MaxTokens | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Refused when set (the route names the field):
    store: StrictBool | None = Field(None, description="Only false: this server keeps no responses.")
    previous_response_id: StrictStr | None = Field(
        None, description="Refused: resend the conversation in 'input'."
    )
    conversation: Any = None
    background: StrictBool | None = None
    prompt: Any = None
    prompt_cache_options: Any = None
    reasoning: Any = None
    text: Any = None
    include: list[StrictStr] | None = None
    top_logprobs: Any = None
