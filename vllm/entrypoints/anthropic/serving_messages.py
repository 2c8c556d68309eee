"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API as a wire
form of the chat request. A Messages body becomes the `ChatCompletionRequest` that
`/v1/chat/completions` serves (same template rendering, tool parsers, tool-choice grammars,
stop handling and usage), and the chat reply, or its stream of chunks, becomes a `Message`
or Anthropic's stream events. Nothing here generates.

    Messages                              chat request
    system (text or text blocks)          a first "system" message
    user text blocks                      a "user" message (blocks joined by the template rules)
    user tool_result blocks               "tool" messages (tool_call_id = tool_use_id)
    assistant text + tool_use blocks      an "assistant" message with tool_calls
    last message from the assistant       continue_final_message (the reply continues it)
    tools[].input_schema                  tools[].function.parameters
    tool_choice auto / any / tool / none  "auto" / "required" / a named function / "none"
    disable_parallel_tool_use             parallel_tool_calls: false
    max_tokens, stop_sequences            max_tokens, stop
    temperature, top_p, top_k             the same

    chat finish_reason (stop_reason)      Messages stop_reason (stop_sequence)
    "tool_calls"                          "tool_use"
    "length"                              "max_tokens"
    "stop" with a matched stop string     "stop_sequence" (that string)
    "stop" otherwise                      "end_turn"
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import ValidationError

from vllm.entrypoints.anthropic.protocol import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    ErrorResponse,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageParam,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageTokensCount,
    PingEvent,
    StopReason,
    StreamEvent,
    TextBlock,
    TextBlockParam,
    TextDelta,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlock,
    Usage,
    error_body,
)
from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionNamedFunction,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatCompletionToolsParam,
    FunctionDefinition,
    StreamOptions,
    UsageInfo,
)
from vllm.entrypoints.openai.protocol import ErrorResponse as OpenAIErrorResponse
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat

MESSAGES_PATH = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """Whether an HTTP path is the Messages API's (its errors take Anthropic's form)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicServingMessages:
    """The Messages endpoints, served by the chat handler they translate to and from."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest
                             ) -> Message | AsyncGenerator[str, None]:
        """The reply, or its event stream; raises OpenAIError for a request that cannot be
        served as given."""
        result = await self.chat.create_chat_completion(to_chat_request(request))
        if isinstance(result, ChatCompletionResponse):
            return message_of(result)
        return message_events(result)

    async def count_tokens(self, request: CountTokensRequest) -> MessageTokensCount:
        """The prompt's length as generation renders and tokenizes it."""
        chat_request = to_chat_request(request)
        self.chat.check_model(chat_request.model)
        text = await self.chat.render(chat_request)
        ids = await self.chat.tokenize(text, chat_request.add_special_tokens)
        return MessageTokensCount(input_tokens=len(ids))


# ---- request: Messages -> chat ------------------------------------------------------------


def to_chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request of a Messages (or count_tokens) request; raises OpenAIError."""
    _check_tool_choice(request)
    prefill = request.messages[-1].role == "assistant"
    fields: dict[str, Any] = {
        "model": request.model, "messages": chat_messages(request),
        "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if request.tools:
        fields["tools"] = [ChatCompletionToolsParam(function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.input_schema,
            strict=t.strict)) for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = _chat_tool_choice(choice)
        if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences,
                      temperature=request.temperature, top_p=request.top_p,
                      top_k=request.top_k, stream=request.stream)
        if request.stream:  # the usage on every chunk: message_start needs the prompt's
            fields["stream_options"] = StreamOptions(include_usage=True,
                                                     continuous_usage_stats=True)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:  # a value valid for Anthropic but not for chat
        raise OpenAIError(f"The request cannot be served: {e}") from None


def _check_tool_choice(request: CountTokensRequest) -> None:
    """The tool_choice rules in the Messages API's words (the chat request checks the rest)."""
    choice = request.tool_choice
    names = [t.name for t in request.tools or []]
    if choice is not None and not isinstance(choice, ToolChoiceNone) and not names:
        raise OpenAIError(f'tool_choice "{choice.type}" needs tools: the request has none.')
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise OpenAIError(f"tool_choice names the tool {choice.name!r}, which is not among "
                          f"the request's tools ({', '.join(names)}).")


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, ToolChoiceTool):
        return ChatCompletionNamedToolChoiceParam(
            function=ChatCompletionNamedFunction(name=choice.name))
    if isinstance(choice, ToolChoiceAny):
        return "required"
    return choice.type  # "auto", "none"


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages; raises OpenAIError naming a misplaced block."""
    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list) and system:
        messages.append({"role": "system", "content": _text_parts(system)})
    called: list[str] = []  # ids of the tool_use blocks so far
    last = len(request.messages) - 1
    for i, message in enumerate(request.messages):
        if message.role == "assistant":
            messages.append(_assistant_message(i, message, called, i == last))
        else:
            messages += _user_messages(i, message, called)
    return messages


def _text_parts(blocks: list[TextBlockParam]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _assistant_message(i: int, message: MessageParam, called: list[str], final: bool
                       ) -> dict[str, Any]:
    texts: list[TextBlockParam] = []
    tool_calls = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block)
        elif isinstance(block, ToolResultBlockParam):
            raise OpenAIError(f"messages[{i}].content[{j}]: a tool_result block belongs in a "
                              "user message.")
        elif final:
            raise OpenAIError(f"messages[{i}].content[{j}]: the last message, from the "
                              "assistant, is the start of the reply and may hold only text "
                              "(a tool_use block needs its tool_result in a user message).")
        else:
            called.append(block.id)
            tool_calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
    result: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts)}
    if tool_calls:
        result["tool_calls"] = tool_calls
    return result


def _user_messages(i: int, message: MessageParam, called: list[str]) -> list[dict[str, Any]]:
    """A user turn: each tool_result a "tool" message, the text between them user messages
    (in their order)."""
    messages: list[dict[str, Any]] = []
    texts: list[TextBlockParam] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block)
            continue
        if not isinstance(block, ToolResultBlockParam):
            raise OpenAIError(f"messages[{i}].content[{j}]: a tool_use block belongs in an "
                              "assistant message.")
        if block.tool_use_id not in called:
            raise OpenAIError(f"messages[{i}].content[{j}].tool_use_id {block.tool_use_id!r} "
                              "answers no tool_use block of an earlier assistant message.")
        if texts:
            messages.append({"role": "user", "content": _text_parts(texts)})
            texts = []
        content = block.content if isinstance(block.content, str) else "\n".join(
            b.text for b in block.content)
        messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": f"Error: {content}" if block.is_error else content})
    if texts or not messages:
        messages.append({"role": "user", "content": _text_parts(texts)})
    return messages


# ---- reply: chat -> Messages --------------------------------------------------------------


def message_of(response: ChatCompletionResponse) -> Message:
    """The `Message` of a (one-choice) chat reply."""
    [choice] = response.choices
    content: list[ContentBlock] = []
    if choice.message.content:
        content.append(TextBlock(text=choice.message.content))
    for call in choice.message.tool_calls:
        content.append(ToolUseBlock(id=_tool_use_id(), name=call.function.name,
                                    input=json.loads(call.function.arguments)))
    stop_reason, stop_sequence = stop_reason_of(choice.finish_reason, choice.stop_reason)
    return Message(id=_message_id(), content=content, model=response.model,
                   stop_reason=stop_reason, stop_sequence=stop_sequence,
                   usage=usage_of(response.usage))


def stop_reason_of(finish_reason: str | None, stop: int | str | None
                   ) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a chat finish: see the module's table."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage_of(usage: UsageInfo) -> Usage:
    """Anthropic's usage: the prompt split into computed and prefix-cached tokens."""
    details = usage.prompt_tokens_details
    cached = details.cached_tokens or 0 if details is not None else 0
    return Usage(input_tokens=usage.prompt_tokens - cached,
                 output_tokens=usage.completion_tokens, cache_read_input_tokens=cached)


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def event_sse(event: StreamEvent | ErrorResponse) -> str:
    """One server-sent event, named by its type (the anthropic SDK reads the name)."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def message_events(chat_stream: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """The Messages events of a chat stream (closing it, which aborts the request, if the
    client goes away)."""
    translator = EventTranslator()
    try:
        async for piece in chat_stream:
            payload = piece.removeprefix("data: ").rstrip()
            if payload == "[DONE]":
                break
            body = json.loads(payload)
            if "error" in body:
                error = OpenAIErrorResponse.model_validate(body).error
                yield event_sse(error_body(error.message, error.code))
                return
            for event in translator.feed(ChatCompletionStreamResponse.model_validate(body)):
                yield event_sse(event)
        for event in translator.finish():
            yield event_sse(event)
    finally:
        await chat_stream.aclose()


class EventTranslator:
    """Chat chunks in, Messages events out: message_start (and a ping) at the first chunk,
    a text block per run of content, a tool_use block per call (its arguments as
    input_json_delta fragments), and at the end message_delta with the stop reason and the
    usage, then message_stop."""

    def __init__(self) -> None:
        self.message_id = _message_id()
        self.started = False
        self.open_kind: str | None = None  # "text" or "tool_use": the open block's kind
        self.num_blocks = 0
        self.call_blocks: dict[int, int] = {}  # chat tool-call index -> block index
        self.usage = UsageInfo()
        self.stop: tuple[StopReason, str | None] = ("end_turn", None)

    def feed(self, chunk: ChatCompletionStreamResponse) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not self.started:
            self.started = True
            usage = Usage(input_tokens=self.usage.prompt_tokens)
            events += [MessageStartEvent(message=Message(
                id=self.message_id, content=[], model=chunk.model, usage=usage)), PingEvent()]
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                if self.open_kind != "text":
                    events += self._open(TextBlock(text=""))
                events.append(ContentBlockDeltaEvent(index=self.num_blocks - 1,
                                                     delta=TextDelta(text=delta.content)))
            for call in delta.tool_calls:
                if call.id is not None:
                    assert call.function is not None and call.function.name is not None
                    events += self._open(ToolUseBlock(id=_tool_use_id(),
                                                      name=call.function.name, input={}))
                    self.call_blocks[call.index] = self.num_blocks - 1
                fragment = call.function.arguments if call.function is not None else None
                if fragment:
                    events.append(ContentBlockDeltaEvent(
                        index=self.call_blocks[call.index],
                        delta=InputJSONDelta(partial_json=fragment)))
            if choice.finish_reason is not None:
                self.stop = stop_reason_of(choice.finish_reason, choice.stop_reason)
        return events

    def _open(self, block: ContentBlock) -> list[StreamEvent]:
        events = self._close()
        events.append(ContentBlockStartEvent(index=self.num_blocks, content_block=block))
        self.open_kind = block.type
        self.num_blocks += 1
        return events

    def _close(self) -> list[StreamEvent]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [ContentBlockStopEvent(index=self.num_blocks - 1)]

    def finish(self) -> list[StreamEvent]:
        stop_reason, stop_sequence = self.stop
        return [*self._close(),
                MessageDeltaEvent(delta=MessageDelta(stop_reason=stop_reason,
                                                     stop_sequence=stop_sequence),
                                  usage=usage_of(self.usage)),
                MessageStopEvent()]
