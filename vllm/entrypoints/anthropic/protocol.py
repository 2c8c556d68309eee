"""Anthropic Messages API bodies (pydantic): `/v1/messages` and `/v1/messages/count_tokens`
requests, the `Message` reply, its stream events and the error body.

Like the OpenAI bodies, a field this server does not implement is refused by name (400).
Accepted although nothing acts on them, because they cannot change what is generated:
`metadata` (the client's own label) and `cache_control` on blocks and tools (prefix caching
is automatic here: every prompt's full blocks are cached and reused without being asked).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests ---------------------------------------------------------------------------


class CacheControl(AnthropicBaseModel):
    """A prompt-caching breakpoint: advisory (the prefix cache needs no breakpoints)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(AnthropicBaseModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlockParam(AnthropicBaseModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(AnthropicBaseModel):
    """A tool's answer to the call `tool_use_id`, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] = ""
    is_error: bool = False  # honoured: the text the model sees starts with "Error: "
    cache_control: CacheControl | None = None


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam,
                              Field(discriminator="type")]


class MessageParam(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    # A string is one text block.
    content: list[ContentBlockParam]

    @field_validator("content", mode="before")
    @classmethod
    def _text_is_one_block(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value


class ToolParam(AnthropicBaseModel):
    """A client tool: the model answers with a `tool_use` block whose `input` follows
    `input_schema` (server tools, such as web search, do not exist here)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    # Calls must follow input_schema exactly: a grammar enforces it under tool_choice
    # "any" and "tool"; refused under "auto" (nothing enforces it there).
    strict: bool | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema of "type": "object"')
        return value


class ToolChoiceAuto(AnthropicBaseModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(AnthropicBaseModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(AnthropicBaseModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(AnthropicBaseModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class Metadata(AnthropicBaseModel):
    """The client's label of the end user: advisory, accepted and not acted on."""

    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(AnthropicBaseModel):
    """`/v1/messages/count_tokens`: the conversation part of a request."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None


# ---- replies ----------------------------------------------------------------------------


class TextBlock(AnthropicBaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(AnthropicBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(AnthropicBaseModel):
    """Anthropic's split of the prompt: `input_tokens` computed for this request,
    `cache_read_input_tokens` served from the prefix cache (their sum is the prompt's
    length, what count_tokens answers); nothing is written to a cache on request."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(AnthropicBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class MessageTokensCount(AnthropicBaseModel):
    input_tokens: int


# ---- stream events ----------------------------------------------------------------------


class MessageStartEvent(AnthropicBaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class PingEvent(AnthropicBaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(AnthropicBaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(AnthropicBaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(AnthropicBaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str  # fragments that join into the call's input, as JSON text


class ContentBlockDeltaEvent(AnthropicBaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJSONDelta


class ContentBlockStopEvent(AnthropicBaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(AnthropicBaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaEvent(AnthropicBaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage  # totals so far (they replace message_start's)


class MessageStopEvent(AnthropicBaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStartEvent | PingEvent | ContentBlockStartEvent | ContentBlockDeltaEvent
               | ContentBlockStopEvent | MessageDeltaEvent | MessageStopEvent)


# ---- errors -----------------------------------------------------------------------------


class ErrorDetail(AnthropicBaseModel):
    type: str
    message: str


class ErrorResponse(AnthropicBaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail


# Anthropic's error type of each HTTP status this server answers with.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(message: str, status_code: int) -> ErrorResponse:
    """The Anthropic error body of an HTTP error: other 4xx are `invalid_request_error`,
    other 5xx `api_error`."""
    default = "invalid_request_error" if status_code < 500 else "api_error"
    return ErrorResponse(error=ErrorDetail(type=_ERROR_TYPES.get(status_code, default),
                                           message=message))
