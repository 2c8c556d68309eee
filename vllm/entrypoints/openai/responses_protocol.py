"""`/v1/responses` bodies (pydantic): the request, the Response object and its stream events.

The request declares the fields this server acts on, and a few that clients send with their
default values (`include: []`, `truncation: "disabled"`, ...) so that those pass while any
other value is refused by name; a field it does not declare is refused by the validation
handler (`extra="forbid"`). Input items, tools and `text.format` stay plain dicts here:
`serving_responses` checks them item by item, naming the one that is wrong.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from vllm.entrypoints.openai.protocol import OpenAIBaseModel


class ResponsesTextConfig(OpenAIBaseModel):
    # {"type": "text"} | {"type": "json_object"} |
    # {"type": "json_schema", "name", "schema", "strict", "description"}
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # refused (no model here reads it)


class ResponsesStreamOptions(OpenAIBaseModel):
    include_obfuscation: bool | None = None  # refused when true (nothing is obfuscated)


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    # Echoed back in the Response (OpenAI's labels for the client's own use).
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    # Accepted only at their defaults (the Agents SDK always sends `include`).
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM extensions, as on chat completions
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    request_id: str | None = Field(None, min_length=1, max_length=256)

    def unsupported(self) -> str | None:
        """What the request asks for that this server cannot do (None: nothing)."""
        given = {
            "include": bool(self.include),
            "truncation=\"auto\"": self.truncation == "auto",
            "background": bool(self.background),
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
            "reasoning": bool(self.reasoning),
            "service_tier": self.service_tier not in (None, "auto", "default"),
            "text.verbosity": self.text is not None and self.text.verbosity is not None,
            "stream_options.include_obfuscation": bool(
                self.stream_options and self.stream_options.include_obfuscation),
        }
        refused = [name for name, on in given.items() if on]
        if not refused:
            return None
        return (f"{', '.join(refused)}: not supported by this server's Responses API "
                "(leave unset, or at its default).")


# ---- the Response object ---------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # a JSON object, as the model wrote it
    status: ItemStatus = "completed"


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "incomplete", "cancelled"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)


# ---- stream events ----------------------------------------------------------------------
# Every event carries its `type` and the stream's running `sequence_number`.


class StreamEvent(OpenAIBaseModel):
    type: str
    sequence_number: int = 0


class ResponseLifecycleEvent(StreamEvent):
    """response.created, response.in_progress, response.completed, response.incomplete,
    response.failed: the Response as it stands."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """response.output_item.added / .done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """response.content_part.added / .done."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(StreamEvent):
    type: str = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):
    type: str = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(StreamEvent):
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    type: str = "error"
    code: str | None = None
    message: str
    param: str | None = None

