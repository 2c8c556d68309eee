"""`/v1/responses`: OpenAI's Responses API as a translation of chat completions.

A Responses request becomes the `ChatCompletionRequest` that `/v1/chat/completions` serves
(so the chat template, tool parsers, tool-choice grammars, structured outputs, prompt-embeds
parts and usage are the chat path's own), and the chat reply or its chunks become a Response
object or its event stream:

    Responses                               chat completions
    instructions                            a first "system" message
    input (string)                          one "user" message
    message item, input_text/output_text    message, text parts ("developer" -> "system")
    function_call item                      assistant message's tool_calls (id = call_id)
    function_call_output item               "tool" message (tool_call_id = call_id)
    tools [{type, name, parameters}]        tools [{type, function: {name, parameters}}]
    tool_choice {type, name}                tool_choice {type, function: {name}}
    text.format                             response_format
    max_output_tokens                       max_completion_tokens
    previous_response_id                    the stored conversation, then this input

Stored responses (`store`, on by default as with OpenAI) keep their conversation without
the instructions (OpenAI does not carry instructions over to a continuation) in a bounded
in-memory LRU; `GET /v1/responses/{id}` reads them back, and while one is generated shows
it as it stands (status "in_progress"); `DELETE` forgets one, or stops one being generated
(status "cancelled", never stored).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from typing import Any, NamedTuple

from pydantic import ValidationError

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    UsageInfo,
)
from vllm.entrypoints.openai.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import iterate_until, run_until

logger = logging.getLogger(__name__)

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_PART_KEYS = {"input_text": {"type", "text"},
              "output_text": {"type", "text", "annotations", "logprobs"},
              "prompt_embeds": {"type", "data"}}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


# ---- the request: Responses -> chat --------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`; raises OpenAIError naming a bad item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            _check_keys(item, _OUTPUT_KEYS, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _output_text(item.get("output"), where)})
        else:
            raise OpenAIError(f"{where}: items of type {kind!r} are not supported (message, "
                              "function_call and function_call_output are).")
    return messages


def _check_keys(item: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = [key for key in item if key not in allowed]
    if extra:
        raise OpenAIError(f"{where}.{extra[0]}: this server does not support this field.")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(f"{where}.{key} must be a string.")
    return value


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(item, _MESSAGE_KEYS, where)
    role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise OpenAIError(f"{where}.role must be one of {', '.join(_ROLES)}.")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of content parts.")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_KEYS:
            raise OpenAIError(f"{where}.content[{j}]: content parts of type {kind!r} are not "
                              "supported (input_text, output_text and prompt_embeds are).")
        _check_keys(part, _PART_KEYS[kind], f"{where}.content[{j}]")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _string(part, "text", f"{where}.content[{j}]")})
        else:
            parts.append(part)  # prompt_embeds: the chat path decodes and places it
    return {"role": role, "content": parts}


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function_call joins the assistant turn before it (calls of one turn are one
    assistant message with several tool_calls), or starts one."""
    _check_keys(item, _CALL_KEYS, where)
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's `output`: a string, or input_text parts (joined)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise OpenAIError(f"{where}.output must be a string or a list of input_text parts.")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools; raises OpenAIError for other kinds."""
    if tools is None:
        return None
    result = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise OpenAIError(f"tools[{i}]: tools of type {tool.get('type')!r} are not "
                              "supported (only function tools are).")
        _check_keys(tool, _TOOL_KEYS, f"tools[{i}]")
        result.append({"type": "function", "function": {
            key: value for key, value in tool.items() if key != "type" and value is not None}})
    return result


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) \
            or set(choice) != {"type", "name"}:
        raise OpenAIError(f"tool_choice {choice} is not supported: give \"auto\", \"none\", "
                          "\"required\" or {\"type\": \"function\", \"name\": NAME}.")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    if text_format is None:
        return None
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        _check_keys(text_format, {"type"}, "text.format")
        return {"type": kind}
    if kind != "json_schema":
        raise OpenAIError(f"text.format.type {kind!r} is not supported (text, json_object "
                          "and json_schema are).")
    _check_keys(text_format, {"type", "name", "schema", "strict", "description"},
                "text.format")
    if not isinstance(text_format.get("schema"), dict):
        raise OpenAIError("text.format of type json_schema needs a schema (an object).")
    spec = {key: text_format[key] for key in ("name", "schema", "strict", "description")
            if text_format.get(key) is not None}
    spec.setdefault("name", "response")
    return {"type": "json_schema", "json_schema": spec}


def chat_request(request: ResponsesRequest, history: list[dict[str, Any]],
                 response_id: str) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request that serves `request` after `history` (a stored conversation), and
    the conversation it continues into (history + this input, without the instructions)."""
    unsupported = request.unsupported()
    if unsupported is not None:
        raise OpenAIError(unsupported)
    conversation = [*history, *input_messages(request.input)]
    system = [{"role": "system", "content": request.instructions}] \
        if request.instructions is not None else []
    body: dict[str, Any] = {
        "model": request.model, "messages": [*system, *conversation],
        "max_completion_tokens": request.max_output_tokens,
        "tools": chat_tools(request.tools), "tool_choice": chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": response_format(request.text.format if request.text else None),
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "request_id": response_id,
    }
    for name in ("temperature", "top_p", "seed", "stop", "top_k", "min_p",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "cache_salt"):
        body[name] = getattr(request, name)
    if request.ignore_eos:
        body["ignore_eos"] = True
    try:
        chat = ChatCompletionRequest.model_validate(
            {key: value for key, value in body.items() if value is not None})
    except ValidationError as e:
        raise OpenAIError(_validation_message(e)) from None
    return chat, conversation


def _validation_message(error: ValidationError) -> str:
    """The chat model's complaint, in the Responses request's words (tools.0.function.name
    -> tools.0.name)."""
    parts = []
    for err in error.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "function")
        where = where.replace("response_format.json_schema", "text.format")
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts)


# ---- the reply: chat -> Responses ---------------------------------------------------------


def random_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: UsageInfo | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.prompt_tokens + usage.completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached or 0))


def finish(response: ResponseObject, finish_reason: str | None) -> None:
    """Sets the final status: a reply cut by max_output_tokens is incomplete."""
    response.completed_at = int(time.time())
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        for item in response.output:
            if isinstance(item, OutputMessage):
                item.status = "incomplete"
    else:
        response.status = "completed"


def output_items(chat: ChatCompletionResponse) -> list[OutputItem]:
    """A chat reply's message as output items: its text (if any, or if there is nothing
    else), then one function_call per tool call."""
    message = chat.choices[0].message
    items: list[OutputItem] = []
    if message.content or not message.tool_calls:
        items.append(OutputMessage(id=random_item_id("msg"),
                                   content=[OutputText(text=message.content or "")]))
    items += [FunctionCallItem(id=random_item_id("fc"), call_id=call.id,
                               name=call.function.name, arguments=call.function.arguments)
              for call in message.tool_calls]
    return items


def assistant_turn(output: list[OutputItem]) -> list[dict[str, Any]]:
    """The output as the chat message a continuation renders after the conversation."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage)
                   for part in item.content)
    calls = [{"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, FunctionCallItem)]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ResponseStore:
    """Stored responses and their conversations, least recently used evicted first when
    either bound is passed. In memory only: a restart forgets them."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 256 * 2**20) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.chars = 0
        self.entries: OrderedDict[str, tuple[ResponseObject, list[dict[str, Any]], int]] = \
            OrderedDict()

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        size = len(response.model_dump_json()) + len(json.dumps(conversation, default=str))
        if size > self.max_chars:
            logger.warning("Response %s (%d characters) is larger than the response store "
                           "and was not stored.", response.id, size)
            return
        self.entries[response.id] = (response, conversation, size)
        self.chars += size
        while len(self.entries) > self.max_responses or self.chars > self.max_chars:
            _, (_, _, evicted) = self.entries.popitem(last=False)
            self.chars -= evicted

    def get(self, response_id: str) -> tuple[ResponseObject, list[dict[str, Any]]]:
        """The response and its conversation; raises a 404 OpenAIError for an unknown id."""
        entry = self.entries.get(response_id)
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found (unknown, not "
                              "stored, or evicted from this server's response store).",
                              "NotFoundError", 404)
        self.entries.move_to_end(response_id)
        return entry[0], entry[1]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        _, _, size = self.entries.pop(response_id)
        self.chars -= size


# ---- streaming -------------------------------------------------------------------------------


class EventWriter:
    """Turns a chat stream's chunks into Responses events: each output item opened
    (output_item.added; a message also content_part.added), grown (output_text.delta,
    function_call_arguments.delta) and closed (the .done events) in order, numbered by
    `sequence_number`."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence_number = 0
        self.open: OutputItem | None = None
        self.calls: dict[int, FunctionCallItem] = {}  # chat's tool-call index -> item
        self.finish_reason: str | None = None

    def event(self, event: StreamEvent) -> StreamEvent:
        event.sequence_number = self.sequence_number
        self.sequence_number += 1
        return event

    def lifecycle(self, kind: str) -> StreamEvent:
        return self.event(ResponseLifecycleEvent(
            type=f"response.{kind}", response=self.response.model_copy(deep=True)))

    def feed(self, chunk: ChatCompletionStreamResponse) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if chunk.usage is not None:
            self.response.usage = response_usage(chunk.usage)
        for choice in chunk.choices:
            self.finish_reason = choice.finish_reason or self.finish_reason
            if choice.delta.content:
                events += self._text(choice.delta.content)
            for call in choice.delta.tool_calls:
                function = call.function
                if call.id is not None and function is not None and function.name:
                    events += self._close()
                    item = FunctionCallItem(id=random_item_id("fc"), call_id=call.id,
                                            name=function.name, arguments="",
                                            status="in_progress")
                    self.calls[call.index] = item
                    events += self._open(item)
                item = self.calls[call.index]
                if function is not None and function.arguments:
                    item.arguments += function.arguments
                    events.append(self.event(ArgumentsDeltaEvent(
                        item_id=item.id, output_index=self._index(item),
                        delta=function.arguments)))
        return events

    def _index(self, item: OutputItem) -> int:
        return next(i for i, known in enumerate(self.response.output) if known is item)

    def _open(self, item: OutputItem) -> list[StreamEvent]:
        self.response.output.append(item)
        self.open = item
        events = [self.event(OutputItemEvent(type="response.output_item.added",
                                             output_index=self._index(item),
                                             item=item.model_copy(deep=True)))]
        if isinstance(item, OutputMessage):
            events.append(self.event(ContentPartEvent(
                type="response.content_part.added", item_id=item.id,
                output_index=self._index(item), part=OutputText(text=""))))
        return events

    def _text(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not isinstance(self.open, OutputMessage):
            events += self._close()
            events += self._open(OutputMessage(id=random_item_id("msg"), status="in_progress",
                                               content=[OutputText(text="")]))
        assert isinstance(self.open, OutputMessage)
        self.open.content[0].text += delta
        events.append(self.event(TextDeltaEvent(item_id=self.open.id,
                                                output_index=self._index(self.open),
                                                delta=delta)))
        return events

    def _close(self, cut: bool = False) -> list[StreamEvent]:
        """Closes the open item: "incomplete" if `cut` (the response stopped) or it is text
        cut by the token limit, else "completed"."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self._index(item)
        events: list[StreamEvent] = []
        item.status = "incomplete" if cut or (self.finish_reason == "length"
                                              and isinstance(item, OutputMessage)) \
            else "completed"
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(self.event(TextDoneEvent(item_id=item.id, output_index=index,
                                                   text=part.text)))
            events.append(self.event(ContentPartEvent(
                type="response.content_part.done", item_id=item.id, output_index=index,
                part=part.model_copy())))
        else:
            events.append(self.event(ArgumentsDoneEvent(item_id=item.id, output_index=index,
                                                        name=item.name,
                                                        arguments=item.arguments)))
        events.append(self.event(OutputItemEvent(type="response.output_item.done",
                                                 output_index=index,
                                                 item=item.model_copy(deep=True))))
        return events

    def end(self) -> list[StreamEvent]:
        """Closes the open item; the last event: response.completed or .incomplete."""
        events: list[StreamEvent] = []
        if not self.response.output:  # nothing said: one empty message, as non-streamed
            events += self._open(OutputMessage(id=random_item_id("msg"), status="in_progress",
                                               content=[OutputText(text="")]))
        events += self._close()
        finish(self.response, self.finish_reason)
        return [*events, self.lifecycle(self.response.status)]

    def cancel(self) -> list[StreamEvent]:
        """Closes the open item as it stands; the last event: response.failed, the response
        "cancelled" (deleted while it streamed; the stream has no event of its own for it)."""
        events = self._close(cut=True)
        self.response.status = "cancelled"
        return [*events, self.lifecycle("failed")]

    def fail(self, error: Exception) -> list[StreamEvent]:
        message = error.message if isinstance(error, OpenAIError) else str(error)
        self.response.status = "failed"
        self.response.error = ResponseError(code="server_error", message=message)
        return [self.event(ErrorEvent(code="server_error", message=message)),
                self.lifecycle("failed")]


async def chat_chunks(chat_events: AsyncGenerator[str, None]
                      ) -> AsyncGenerator[ChatCompletionStreamResponse, None]:
    """The chat route's server-sent events read back as chunks; its error event raises."""
    async for event in chat_events:
        payload = event.removeprefix("data: ").rstrip()
        if payload == "[DONE]":
            return
        body = json.loads(payload)
        if "error" in body:
            error = body["error"]
            raise OpenAIError(error["message"], error["type"], error["code"])
        yield ChatCompletionStreamResponse.model_validate(body)


def sse_event(event: StreamEvent) -> str:
    """One server-sent event, named by its type as OpenAI sends them."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


# ---- the handler -----------------------------------------------------------------------------


class StartedResponse(NamedTuple):
    response: ResponseObject  # in progress: the request's settings, no output yet
    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]  # without the instructions


class OpenAIServingResponses:
    """`/v1/responses`: translates to and from the chat handler, and keeps stored
    responses."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()
        # Responses being generated that will be stored, by id: `retrieve` shows them as
        # they stand (status "in_progress", the output so far).
        self.in_flight: dict[str, ResponseObject] = {}
        self.deleting: dict[str, asyncio.Event] = {}  # their `delete` events, by id

    def start(self, request: ResponsesRequest) -> StartedResponse:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            if request.previous_response_id in self.in_flight:
                raise OpenAIError(f"Previous response with id '{request.previous_response_id}'"
                                  " is still in progress: continue it once it has completed.")
            _, history = self.store.get(request.previous_response_id)
        response_id = f"resp_{request.request_id or uuid.uuid4().hex}"
        chat, conversation = chat_request(request, history, response_id)
        response = ResponseObject(
            id=response_id, model=self.chat.response_model(request.model),
            instructions=request.instructions,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            tools=request.tools or [],
            text={"format": (request.text.format if request.text and request.text.format
                             else {"type": "text"})},
            temperature=request.temperature, top_p=request.top_p,
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store is not False,
            metadata=request.metadata, user=request.user,
            safety_identifier=request.safety_identifier)
        return StartedResponse(response, chat, conversation)

    async def create_response(self, request: ResponsesRequest
                              ) -> ResponseObject | AsyncGenerator[str, None]:
        started = self.start(request)
        if started.chat.stream:
            result = await self.chat.create_chat_completion(started.chat)
            assert not isinstance(result, ChatCompletionResponse)
            return self._stream(started, result)
        response = started.response
        with self._generating(response) as deleted:
            result = await run_until(self.chat.create_chat_completion(started.chat), deleted)
        if result is None:  # deleted while it was generated: stopped, and not stored
            response.status = "cancelled"
            return response
        assert isinstance(result, ChatCompletionResponse)
        response.output = output_items(result)
        response.usage = response_usage(result.usage)
        finish(response, result.choices[0].finish_reason)
        self._keep(response, started.conversation)
        return response

    async def _stream(self, started: StartedResponse, chat_events: AsyncGenerator[str, None]
                      ) -> AsyncGenerator[str, None]:
        writer = EventWriter(started.response)
        with self._generating(started.response) as deleted:
            yield sse_event(writer.lifecycle("created"))
            yield sse_event(writer.lifecycle("in_progress"))
            async with aclosing(chat_events):
                try:
                    async for chunk in iterate_until(chat_chunks(chat_events), deleted):
                        for event in writer.feed(chunk):
                            yield sse_event(event)
                except Exception as e:
                    for event in writer.fail(e):
                        yield sse_event(event)
                    return
            if deleted.is_set():  # stopped, and not stored
                for event in writer.cancel():
                    yield sse_event(event)
                return
            for event in writer.end():
                yield sse_event(event)
            self._keep(writer.response, started.conversation)

    @contextmanager
    def _generating(self, response: ResponseObject) -> Iterator[asyncio.Event]:
        """Shows a response that will be stored to `retrieve` and `delete` while it is
        generated (until it is stored, fails, or its client goes away); yields the event
        that `delete` sets to stop it."""
        deleted = asyncio.Event()
        if not response.store:
            yield deleted
            return
        self.in_flight[response.id] = response
        self.deleting[response.id] = deleted
        try:
            yield deleted
        finally:
            self.in_flight.pop(response.id, None)
            self.deleting.pop(response.id, None)

    def _keep(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if response.store:
            self.store.put(response, [*conversation, *assistant_turn(response.output)])

    def retrieve(self, response_id: str) -> ResponseObject:
        """A stored response, or one being generated as it stands now."""
        response = self.in_flight.get(response_id)
        if response is not None:
            return response.model_copy(deep=True)
        return self.store.get(response_id)[0]

    def delete(self, response_id: str) -> None:
        """Deletes a stored response; one being generated is stopped (its engine request
        aborted) and never stored: a stream then ends with the response "cancelled", a
        request waiting for the whole response gets it "cancelled". Raises a 404
        OpenAIError for an unknown id."""
        if response_id in self.deleting:
            self.deleting.pop(response_id).set()
            self.in_flight.pop(response_id, None)
            return
        self.store.delete(response_id)
