"""`/v1/responses` as a translation (no server): Responses requests into the chat request
`/v1/chat/completions` serves, chat replies and chunks back into Response objects and
events, and the bounded response store."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokenUsageInfo,
    ToolCall,
    UsageInfo,
)
from vllm.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputItemEvent,
    OutputMessage,
    ResponseObject,
    ResponsesRequest,
)
from vllm.entrypoints.openai.serving_responses import (
    EventWriter,
    OpenAIServingResponses,
    ResponseStore,
    assistant_turn,
    chat_chunks,
    chat_request,
    finish,
    output_items,
    response_usage,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}


def translate(history: list | None = None, **body):
    request = ResponsesRequest.model_validate({"model": "m", **body})
    return chat_request(request, history or [], "resp_1")


def test_string_input_and_instructions_become_system_then_user() -> None:
    chat, conversation = translate(input="Hi", instructions="Be brief.",
                                   max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3)
    assert chat.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]
    assert conversation == [{"role": "user", "content": "Hi"}]  # instructions not carried
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed) == \
        (7, 0.5, 0.9, 3)
    assert chat.request_id == "resp_1" and not chat.stream and chat.stream_options is None


def test_items_become_chat_messages() -> None:
    """Text parts of either kind, developer as system, a turn's function calls joined into
    one assistant message (call_id as the tool call id), outputs as tool messages."""
    embeds = {"type": "prompt_embeds", "data": "AAAA"}
    chat, _ = translate(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in Paris"}, embeds]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "19 "}, {"type": "input_text", "text": "C"}]},
    ], history=[{"role": "user", "content": "Earlier"}])
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert chat.messages == [
        {"role": "user", "content": "Earlier"},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, embeds]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [
             {"id": "c1", **call, "function": {**call["function"],
                                               "arguments": '{"city": "Paris"}'}},
             {"id": "c2", **call, "function": {**call["function"],
                                               "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "19 C"},
    ]


def test_tools_tool_choice_and_text_format_become_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat, _ = translate(input="x", tools=[WEATHER], parallel_tool_calls=False,
                        tool_choice={"type": "function", "name": "get_weather"},
                        text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                         "strict": True}}, stream=True)
    [tool] = chat.tools or []
    assert tool.function.model_dump(exclude_none=True) == {
        key: value for key, value in WEATHER.items() if key != "type"}
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.parallel_tool_calls is False
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == schema
    assert chat.response_format.json_schema.strict is True
    assert chat.stream and chat.include_usage_in_stream
    for kind in ("json_object", "text"):
        plain, _ = translate(input="x", text={"format": {"type": kind}})
        assert plain.response_format is not None and plain.response_format.type == kind
    assert translate(input="x", tool_choice="required", tools=[WEATHER])[0].tool_choice == \
        "required"


@pytest.mark.parametrize("body, named", [
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "include_obfuscation"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "'web_search_call'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]: content parts of type 'input_image'"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]: tools of type 'web_search'"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools.0.name"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "needs a schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type 'grammar'"),
])
def test_what_is_not_implemented_is_refused_by_name(body: dict, named: str) -> None:
    with pytest.raises(OpenAIError) as info:
        translate(**{"input": "x", **body})
    assert named in info.value.message and info.value.status_code == 400


def test_unknown_fields_and_defaults() -> None:
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"input": "x", "prompt_cache_key": "k"})
    assert "prompt_cache_key" in str(info.value)
    # What the Agents SDK always sends, at the defaults, passes.
    translate(input="x", include=[], truncation="disabled", service_tier="auto",
              metadata={"k": "v"}, store=False)


def _chat_reply(content: str | None, calls: list[tuple[str, str]], finish_reason: str
                ) -> ChatCompletionResponse:
    message = ChatMessage(role="assistant", content=content, tool_calls=[
        ToolCall(id=f"call-{i}", function=FunctionCall(name=name, arguments=arguments))
        for i, (name, arguments) in enumerate(calls)])
    return ChatCompletionResponse(
        id="c", model="m", choices=[ChatCompletionResponseChoice(
            index=0, message=message, finish_reason=finish_reason)],
        usage=UsageInfo(prompt_tokens=5, completion_tokens=3, total_tokens=8,
                        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=2)))


def test_a_chat_reply_becomes_output_items() -> None:
    items = output_items(_chat_reply("Let me see.", [("f", '{"a": 1}'), ("g", "{}")], "tool_calls"))
    assert [type(item) for item in items] == [OutputMessage, FunctionCallItem, FunctionCallItem]
    assert items[0].content[0].text == "Let me see."  # type: ignore[union-attr]
    assert [(i.call_id, i.name, i.arguments) for i in items[1:]] == [  # type: ignore[union-attr]
        ("call-0", "f", '{"a": 1}'), ("call-1", "g", "{}")]
    assert len({item.id for item in items}) == 3
    assert assistant_turn(items) == [{"role": "assistant", "content": "Let me see.",
                                      "tool_calls": [
        {"id": "call-0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call-1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]
    [only_call] = output_items(_chat_reply(None, [("f", "{}")], "tool_calls"))
    assert isinstance(only_call, FunctionCallItem)
    [empty] = output_items(_chat_reply("", [], "stop"))
    assert isinstance(empty, OutputMessage) and empty.content[0].text == ""
    usage = response_usage(_chat_reply("x", [], "stop").usage)
    assert usage is not None and (usage.input_tokens, usage.output_tokens, usage.total_tokens,
                                  usage.input_tokens_details.cached_tokens) == (5, 3, 8, 2)


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    response = ResponseObject(id="r", model="m", output=output_items(_chat_reply("abc", [],
                                                                                 "length")))
    finish(response, "length")
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    finish(done := ResponseObject(id="r", model="m"), "stop")
    assert done.status == "completed" and done.completed_at is not None


def _chunk(content: str | None = None, calls: list[DeltaToolCall] | None = None,
           finish_reason: str | None = None, usage: UsageInfo | None = None
           ) -> ChatCompletionStreamResponse:
    choices = [] if usage is not None else [ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(content=content, tool_calls=calls or []),
        finish_reason=finish_reason)]
    return ChatCompletionStreamResponse(id="c", model="m", choices=choices, usage=usage)


def _call(index: int, arguments: str, name: str | None = None) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=f"call-{index}" if name else None,
                         type="function" if name else None,
                         function=DeltaFunctionCall(name=name, arguments=arguments))


def test_chat_chunks_become_the_event_sequence() -> None:
    writer = EventWriter(ResponseObject(id="r", model="m"))
    events = [writer.lifecycle("created"), writer.lifecycle("in_progress")]
    for chunk in (_chunk(""), _chunk("Hel"), _chunk("lo"),
                  _chunk(calls=[_call(0, '{"a":', "f")]), _chunk(calls=[_call(0, " 1}")]),
                  _chunk(calls=[_call(1, "{}", "g")], finish_reason="tool_calls"),
                  _chunk(usage=UsageInfo(prompt_tokens=4, completion_tokens=6))):
        events += writer.feed(chunk)
    events += writer.end()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[attr-defined]
    assert final.status == "completed" and final.output_text == "Hello"
    assert [(i.call_id, i.name, i.arguments, i.status) for i in final.output[1:]] == [
        ("call-0", "f", '{"a": 1}', "completed"), ("call-1", "g", "{}", "completed")]
    assert final.usage.input_tokens == 4 and final.usage.total_tokens == 10
    assert [e.output_index for e in events if isinstance(e, OutputItemEvent)
            and e.type == "response.output_item.done"] == [0, 1, 2]
    assert events[0].response.output == []  # type: ignore[attr-defined]


def test_an_empty_or_cut_stream_still_closes_its_message() -> None:
    writer = EventWriter(ResponseObject(id="r", model="m"))
    events = writer.feed(_chunk("", finish_reason="stop")) + writer.end()
    assert [e.type for e in events][-2:] == ["response.output_item.done", "response.completed"]
    cut = EventWriter(ResponseObject(id="r", model="m"))
    events = cut.feed(_chunk("abc", finish_reason="length")) + cut.end()
    assert events[-1].type == "response.incomplete"
    assert cut.response.output[0].status == "incomplete"
    failed = EventWriter(ResponseObject(id="r", model="m"))
    events = failed.fail(OpenAIError("engine failed", "InternalServerError", 500))
    assert [e.type for e in events] == ["error", "response.failed"]
    assert failed.response.error is not None and failed.response.error.message == \
        "engine failed"


def test_the_store_is_a_bounded_lru() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(ResponseObject(id=name, model="m"), [{"role": "user", "content": name}])
    assert store.get("a")[1] == [{"role": "user", "content": "a"}]  # a is now the newest
    store.put(ResponseObject(id="c", model="m"), [])
    assert list(store.entries) == ["a", "c"]
    with pytest.raises(OpenAIError) as info:
        store.get("b")
    assert info.value.status_code == 404 and "'b' not found" in info.value.message
    store.delete("a")
    assert list(store.entries) == ["c"]
    size = store.chars
    small = ResponseStore(max_chars=2 * size + 10)
    for name in ("x", "y", "z"):
        small.put(ResponseObject(id=name, model="m"), [])
    assert list(small.entries) == ["y", "z"] and small.chars <= small.max_chars
    small.put(ResponseObject(id="huge", model="m"), [{"content": "x" * small.max_chars}])
    assert "huge" not in small.entries


def test_chat_events_are_read_back_as_chunks() -> None:
    """The chat route's SSE (what `/v1/chat/completions` streams) back into chunks; its
    error event raises the error it carries."""
    import asyncio

    from vllm.entrypoints.openai.serving_engine import error_response, sse

    async def read(events: list[str]) -> list[ChatCompletionStreamResponse]:
        async def stream():
            for event in events:
                yield event
        return [chunk async for chunk in chat_chunks(stream())]

    chunks = [_chunk("Hi"), _chunk(usage=UsageInfo(prompt_tokens=1))]
    assert asyncio.run(read([*map(sse, chunks), "data: [DONE]\n\n"])) == chunks
    failed = sse(error_response(OpenAIError("engine failed", "InternalServerError", 500)))
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read([sse(chunks[0]), failed]))
    assert (info.value.message, info.value.status_code) == ("engine failed", 500)


def test_a_streamed_response_is_retrievable_while_in_flight() -> None:
    """GET on a stored response still streaming: as it stands ("in_progress", the text so
    far); once the stream ends, the stored one. One not stored is never shown; one in
    flight cannot be continued yet."""
    import asyncio

    from vllm.entrypoints.openai.serving_engine import sse

    class Chat:  # the chat handler's two methods the Responses handler calls
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        def response_model(self, model: str | None) -> str:
            return "m"

        async def create_chat_completion(self, request):
            async def events():
                yield sse(_chunk("Hel"))
                await self.gate.wait()
                yield sse(_chunk("lo", finish_reason="stop"))
                yield "data: [DONE]\n\n"
            return events()

    async def run() -> None:
        chat = Chat()
        serving = OpenAIServingResponses(chat)  # type: ignore[arg-type]
        unstored = await serving.create_response(ResponsesRequest.model_validate(
            {"model": "m", "input": "hi", "stream": True, "store": False}))
        stream = await serving.create_response(ResponsesRequest.model_validate(
            {"model": "m", "input": "hi", "stream": True}))
        assert not isinstance(stream, ResponseObject)
        assert not isinstance(unstored, ResponseObject)
        events = [await anext(stream) for _ in range(5)]  # created ... the first delta
        assert "response.output_text.delta" in events[-1]
        [response_id] = serving.in_flight
        await anext(unstored)
        assert list(serving.in_flight) == [response_id]
        now = serving.retrieve(response_id)
        assert now.status == "in_progress" and now.output_text == "Hel"
        with pytest.raises(OpenAIError, match="still in progress") as info:
            serving.start(ResponsesRequest.model_validate(
                {"model": "m", "input": "?", "previous_response_id": response_id}))
        assert info.value.status_code == 400
        chat.gate.set()
        rest = [event async for event in stream]
        assert "response.completed" in rest[-1]
        assert serving.in_flight == {}
        done = serving.retrieve(response_id)
        assert done.status == "completed" and done.output_text == "Hello"
        assert now.status == "in_progress"  # what GET returned was a snapshot
        await unstored.aclose()

    asyncio.run(run())


def test_deleting_a_response_in_flight_stops_it() -> None:
    """DELETE on a stored response still generating: its generation stops at once (the
    chat stream's waiting read is cancelled, which aborts the engine request), a stream
    ends with the response "cancelled" (response.failed: the stream has no event of its
    own for it), a request waiting for the whole response gets it "cancelled", and
    nothing is stored."""
    import asyncio

    from vllm.entrypoints.openai.serving_engine import sse

    class Chat:  # the chat handler's two methods the Responses handler calls
        def __init__(self) -> None:
            self.stopped: list[str] = []

        def response_model(self, model: str | None) -> str:
            return "m"

        async def create_chat_completion(self, request):
            async def events():
                try:
                    yield sse(_chunk("Hel"))
                    await asyncio.Event().wait()  # the next token never comes
                finally:
                    self.stopped.append("stream")
            if request.stream:
                return events()
            try:
                await asyncio.Event().wait()
            finally:
                self.stopped.append("whole")

    def request(stream: bool) -> ResponsesRequest:
        return ResponsesRequest.model_validate({"model": "m", "input": "hi", "stream": stream})

    async def run() -> None:
        chat = Chat()
        serving = OpenAIServingResponses(chat)  # type: ignore[arg-type]
        stream = await serving.create_response(request(stream=True))
        assert not isinstance(stream, ResponseObject)
        events = [await anext(stream) for _ in range(5)]  # created ... the first delta
        assert "response.output_text.delta" in events[-1]
        [response_id] = serving.in_flight
        serving.delete(response_id)
        rest = [event async for event in stream]
        assert chat.stopped == ["stream"]
        assert [e.split("\n")[0] for e in rest] == [
            "event: response.output_text.done", "event: response.content_part.done",
            "event: response.output_item.done", "event: response.failed"]
        assert '"status":"cancelled"' in rest[-1] and '"text":"Hel"' in rest[-1]
        assert '"status":"incomplete"' in rest[-2]  # the message it stopped in
        assert serving.in_flight == {} and serving.deleting == {}
        for gone in (serving.retrieve, serving.delete):
            with pytest.raises(OpenAIError, match="not found") as info:
                gone(response_id)
            assert info.value.status_code == 404

        whole = asyncio.ensure_future(serving.create_response(request(stream=False)))
        while not serving.in_flight:
            await asyncio.sleep(0)
        [response_id] = serving.in_flight
        serving.delete(response_id)
        response = await whole
        assert isinstance(response, ResponseObject)
        assert response.status == "cancelled" and response.id == response_id
        assert chat.stopped == ["stream", "whole"]
        assert serving.in_flight == {} and not serving.store.entries

    asyncio.run(run())
