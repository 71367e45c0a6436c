"""Request bodies of the OpenAI-compatible routes (pydantic; the OpenAPI schema comes from here).

Unknown fields are ignored, as the hosted API's clients send many optional ones. Fields that
would change the answer and that this server cannot honour (non-function tools, ``suffix``,
``best_of`` other than ``n``, ``logprobs`` with parsed tool calls)
are refused by the routes with a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=1_000_000)]
#: torch.Generator.manual_seed's range: any int64 or uint64 (a negative seed is taken mod 2**64).
Seed = Annotated[StrictInt, Field(ge=-(1 << 63), le=(1 << 64) - 1)]


class TextPart(BaseModel):
    """A content part; only text is supported."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr = Field(description="The arguments as the text of a JSON object.")


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="An assistant message's calls.")
    tool_call_id: StrictStr | None = Field(None, description="A tool message: the call it answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class CachedGeneration(BaseModel):
    """The fields every OpenAI generation route shares (chat, completions, responses)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stream: StrictBool | None = False
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = Field(
        None, description="Recorded (trace log) for routing; caching is automatic on every full prompt block."
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None,
        description="'in_memory': the default TTL (5 minutes, refreshed on use); '24h': the 24-hour class.",
    )


class Sampling(CachedGeneration):
    top_k: Annotated[StrictInt, Field(ge=0)] | None = Field(
        None, description="Extension: sample from the k most likely tokens (0: off)."
    )
    seed: Seed | None = Field(None, description="Reproducible sampling: an integer from -2**63 to 2**64 - 1.")
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="Choices decoded from one prefill of the prompt; at most the server's --max-batch."
    )

    response_format: dict[str, Any] | None = Field(
        None,
        description="Structured output: {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
        "'json_schema': {'name': ..., 'schema': {...}, 'strict': true}}.",
    )
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's extension: one of json (a schema), regex, choice (strings) or grammar (Lark).",
    )
    guided_json: dict[str, Any] | StrictStr | None = Field(None, description="vLLM's older name: a schema.")
    guided_regex: StrictStr | None = Field(None, description="vLLM's older name for a regex.")
    guided_choice: list[StrictStr] | None = Field(None, description="vLLM's older name for a choice.")
    guided_grammar: StrictStr | None = Field(None, description="vLLM's older name for a Lark/GBNF grammar.")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = Field(
        None, description="Accepted; the schema is not enforced while decoding."
    )


class ChatTool(BaseModel):
    """``{"type": "function", "function": {...}}``; other types are refused by name."""

    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    function: FunctionDefinition | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = Field(
        None, description="Each output token's logprob under the model (before temperature, top-p, top-k)."
    )
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = Field(
        None, description="With logprobs: the most likely alternatives per token (0-20)."
    )
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = Field(
        None,
        description="vLLM's extension: each prompt token's logprob and the k (0-20) likeliest tokens at its "
        "position, recomputed with the cache bypassed (a top-level prompt_logprobs).",
    )


class CompletionRequest(Sampling):
    """POST /v1/completions. ``prompt``: a string, a one-string list, or token ids."""

    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
    )
    max_tokens: MaxTokens | None = 16
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = Field(
        None, description="Each output token's log-probability and the k (0-5) most likely alternatives."
    )
    best_of: Annotated[StrictInt, Field(ge=1)] | None = Field(None, description="Only equal to n (or unset).")
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = Field(
        None,
        description="vLLM's extension: each prompt token's logprob and the k (0-20) likeliest tokens at its "
        "position, recomputed with the cache bypassed (choices[].prompt_logprobs).",
    )
