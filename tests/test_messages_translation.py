"""The Messages API's translation, without a server: Anthropic bodies to the chat request
`/v1/chat/completions` serves, chat replies and stream chunks back to a `Message` and
Anthropic's events, and the error body. (Against a live server and the anthropic SDK:
test_server_messages.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from pydantic import ValidationError

from vllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
)
from vllm.entrypoints.anthropic.serving_messages import (
    EventTranslator,
    is_messages_path,
    message_events,
    message_of,
    to_chat_request,
)
from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.tool_calls import check_tool_request, tool_choice_constraint

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


def request(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({
        "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
        **body})


def test_a_conversation_with_tools_becomes_the_chat_request() -> None:
    """System blocks, text, a tool_use and its tool_result (an error) map onto chat
    messages in order; tools and the sampling fields carry over by name."""
    body = request(
        system=[{"type": "text", "text": "Be brief."},
                {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "Try again."}]}],
        tools=[WEATHER], stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=5,
        metadata={"user_id": "u-1"})
    chat = to_chat_request(body)
    assert chat.messages == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                       {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}],
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout"},
        {"role": "user", "content": [{"type": "text", "text": "Try again."}]}]
    assert chat.add_generation_prompt and not chat.continue_final_message
    [tool] = chat.tools or []
    assert (tool.function.name, tool.function.description, tool.function.parameters) == (
        "get_weather", WEATHER["description"], WEATHER["input_schema"])
    assert chat.tool_choice is None  # chat's default with tools: "auto", as Anthropic's
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (
        16, ["\n\n"], 0.5, 0.9, 5)
    assert not chat.stream and chat.stream_options is None
    assert chat.model == "m"


def test_stream_asks_chat_for_the_usage_on_every_chunk() -> None:
    chat = to_chat_request(request(stream=True))
    assert chat.stream and chat.stream_options is not None
    assert chat.stream_options.include_usage and chat.stream_options.continuous_usage_stats


@pytest.mark.parametrize("choice, expect, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_time"}, "get_time", True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice_maps_onto_chat(choice: dict, expect: str, parallel: bool) -> None:
    chat = to_chat_request(request(tools=[WEATHER, TIME], tool_choice=choice))
    got = chat.tool_choice
    if isinstance(got, ChatCompletionNamedToolChoiceParam):
        got = got.function.name
    assert got == expect
    assert chat.parallel_tool_calls is parallel


def test_strict_tools_under_auto_get_chats_grammar() -> None:
    """A strict tool under Anthropic's default "auto" is chat's strict tool under "auto":
    enforced by the tool-choice grammar (a structural tag), not refused."""
    chat = to_chat_request(request(tools=[{**WEATHER, "strict": True}]))
    assert chat.tools is not None and chat.tools[0].function.strict is True
    check_tool_request(chat, "hermes")
    constraint = tool_choice_constraint(chat, "hermes")
    assert constraint is not None and constraint.kind == "structural_tag"


def test_a_final_assistant_message_is_continued() -> None:
    chat = to_chat_request(request(messages=[
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One,"}]))
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.messages[-1] == {"role": "assistant",
                                 "content": [{"type": "text", "text": "One,"}]}


def test_count_tokens_takes_the_conversation_only() -> None:
    chat = to_chat_request(CountTokensRequest.model_validate({
        "model": "m", "system": "S", "messages": [{"role": "user", "content": "Hi"}],
        "tools": [WEATHER]}))
    assert chat.messages[0] == {"role": "system", "content": "S"}
    assert chat.max_tokens is None and not chat.stream
    with pytest.raises(ValidationError, match="max_tokens"):
        CountTokensRequest.model_validate({"model": "m", "max_tokens": 3, "messages": [
            {"role": "user", "content": "Hi"}]})


CALL = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]}


@pytest.mark.parametrize("body, names", [
    ({"messages": [{"role": "user", "content": "Hi"}, CALL]},
     "messages[1].content[0]: the last message"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}]},
     "messages[0].content[0]: a tool_use block belongs in an assistant message"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}, {"role": "user", "content": "?"}]},
     "messages[1].content[0]: a tool_result block belongs in a user message"),
    ({"messages": [{"role": "user", "content": "Hi"}, CALL, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]},
     "tool_use_id 'toolu_2' answers no tool_use block"),
    ({"tool_choice": {"type": "any"}}, 'tool_choice "any" needs tools'),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_stock"}},
     "'get_stock', which is not among the request's tools (get_weather)"),
])
def test_misplaced_blocks_and_bad_tool_choices_are_named(body: dict, names: str) -> None:
    with pytest.raises(OpenAIError) as info:
        to_chat_request(request(**body))
    assert names in info.value.message and info.value.status_code == 400


@pytest.mark.parametrize("body, names", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AA"}}]}]}, "'image'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "citations": []}]}]}, "citations"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "role"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "type"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
])
def test_fields_not_implemented_are_refused_by_name(body: dict, names: str) -> None:
    with pytest.raises(ValidationError) as info:
        request(**body)
    assert names in str(info.value)


def test_max_tokens_is_required() -> None:
    with pytest.raises(ValidationError, match="max_tokens"):
        MessagesRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "Hi"}]})


def chat_response(message: dict, finish_reason: str, stop_reason: Any = None,
                  cached: int = 0) -> ChatCompletionResponse:
    return ChatCompletionResponse.model_validate({
        "id": "chatcmpl-1", "model": "m", "choices": [{
            "index": 0, "message": {"role": "assistant", **message},
            "finish_reason": finish_reason, "stop_reason": stop_reason}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
                  "prompt_tokens_details": {"cached_tokens": cached}}})


def test_a_chat_reply_becomes_a_message() -> None:
    reply = message_of(chat_response({"content": "Sure.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Oslo"}'}}]},
        "tool_calls", cached=16))
    dumped = reply.model_dump()
    assert dumped["id"].startswith("msg_") and dumped["type"] == "message"
    assert dumped["role"] == "assistant" and dumped["model"] == "m"
    text, call = dumped["content"]
    assert text == {"type": "text", "text": "Sure."}
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Oslo"})
    assert (dumped["stop_reason"], dumped["stop_sequence"]) == ("tool_use", None)
    assert dumped["usage"] == {"input_tokens": 14, "output_tokens": 7,
                               "cache_creation_input_tokens": 0,
                               "cache_read_input_tokens": 16}


@pytest.mark.parametrize("finish_reason, stop_reason, expect", [
    ("stop", None, ("end_turn", None)),
    ("stop", 2, ("end_turn", None)),  # an end-of-turn token id
    ("stop", "\n\n", ("stop_sequence", "\n\n")),
    ("length", None, ("max_tokens", None)),
])
def test_stop_reasons(finish_reason: str, stop_reason: Any, expect: tuple) -> None:
    reply = message_of(chat_response({"content": "Hi"}, finish_reason, stop_reason))
    assert (reply.stop_reason, reply.stop_sequence) == expect
    assert [b.model_dump() for b in reply.content] == [{"type": "text", "text": "Hi"}]


def test_an_empty_reply_has_no_blocks() -> None:
    assert message_of(chat_response({"content": ""}, "length")).content == []


def chunk(delta: dict | None = None, usage: dict | None = None, **choice: Any
          ) -> ChatCompletionStreamResponse:
    choices = [] if delta is None else [{"index": 0, "delta": delta, **choice}]
    return ChatCompletionStreamResponse.model_validate(
        {"id": "c", "model": "m", "choices": choices, "usage": usage})


def usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": details}


def test_chat_chunks_become_the_event_sequence() -> None:
    """Text, then two calls (ids, names once; argument fragments), then the finish: the
    exact Anthropic event sequence, with block indices and the final usage."""
    t = EventTranslator()
    events = [e.model_dump() for e in (
        t.feed(chunk({"role": "assistant", "content": ""}, usage(12, 0)))
        + t.feed(chunk({"content": "Let me"}, usage(12, 2, cached=4)))
        + t.feed(chunk({"content": " check."}, usage(12, 3, cached=4)))
        + t.feed(chunk({"tool_calls": [{"index": 0, "id": "a", "type": "function",
                                        "function": {"name": "get_weather",
                                                     "arguments": '{"city": '}}]},
                       usage(12, 8, cached=4)))
        + t.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                       usage(12, 10, cached=4)))
        + t.feed(chunk({"tool_calls": [{"index": 1, "id": "b", "type": "function",
                                        "function": {"name": "get_time", "arguments": ""}}]},
                       usage(12, 14, cached=4)))
        + t.feed(chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
                       usage(12, 15, cached=4), finish_reason="tool_calls"))
        + t.feed(chunk(None, usage(12, 15, cached=4)))
        + t.finish())]
    assert [e["type"] for e in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["id"] == t.message_id and start["content"] == [] and start["model"] == "m"
    assert start["usage"]["input_tokens"] == 12 and start["stop_reason"] is None
    assert events[2] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert [e["delta"]["text"] for e in events[3:5]] == ["Let me", " check."]
    first_call = events[6]["content_block"]
    assert events[6]["index"] == 1 and first_call["name"] == "get_weather"
    assert first_call["id"].startswith("toolu_") and first_call["input"] == {}
    assert json.loads("".join(e["delta"]["partial_json"] for e in events[7:9])) == {
        "city": "Oslo"}
    assert events[9] == {"type": "content_block_stop", "index": 1}
    assert events[10]["index"] == 2 and events[10]["content_block"]["name"] == "get_time"
    assert events[11]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert events[13]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[13]["usage"] == {"input_tokens": 8, "output_tokens": 15,
                                   "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 4}


def test_a_stop_sequence_ends_the_stream_with_its_name() -> None:
    t = EventTranslator()
    t.feed(chunk({"role": "assistant", "content": ""}, usage(5, 0)))
    t.feed(chunk({"content": "A"}, usage(5, 1), finish_reason="stop", stop_reason="B"))
    *_, delta, stop = [e.model_dump() for e in t.finish()]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "B"}
    assert stop == {"type": "message_stop"}


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (422, "invalid_request_error"), (500, "api_error"),
    (503, "overloaded_error")])
def test_error_bodies_take_anthropics_form(status: int, kind: str) -> None:
    assert error_body("bad", status).model_dump() == {
        "type": "error", "error": {"type": kind, "message": "bad"}}


def test_messages_paths() -> None:
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")


class FakeChatStream:
    """A chat stream's SSE text, recording whether it was closed (closing aborts the
    engine request)."""

    def __init__(self, payloads: list[str]) -> None:
        self.payloads = payloads
        self.closed = False

    async def stream(self) -> AsyncGenerator[str, None]:
        try:
            for payload in self.payloads:
                yield f"data: {payload}\n\n"
        finally:
            self.closed = True


ROLE = chunk({"role": "assistant", "content": ""}, usage(5, 0)).model_dump_json()
TEXT = chunk({"content": "Hi"}, usage(5, 1)).model_dump_json()


def read(fake: FakeChatStream, limit: int | None = None
         ) -> tuple[list[tuple[str, dict]], bool]:
    """(event name, data) of the Messages stream, stopping after `limit` events, and
    whether the chat stream was closed by then (checked before asyncio.run would close
    every generator left open)."""
    async def run() -> tuple[list[str], bool]:
        events = []
        generator = message_events(fake.stream())
        async for event in generator:
            events.append(event)
            if len(events) == limit:
                break
        await generator.aclose()
        return events, fake.closed

    texts, closed = asyncio.run(run())
    result = []
    for text in texts:
        name_line, data_line = text.strip().split("\n")
        result.append((name_line.removeprefix("event: "),
                       json.loads(data_line.removeprefix("data: "))))
    return result, closed


def test_a_failure_after_the_200_is_an_error_event() -> None:
    error = json.dumps({"error": {"message": "engine failed", "type": "InternalServerError",
                                  "code": 500}})
    events, closed = read(FakeChatStream([ROLE, TEXT, error, "[DONE]"]))
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                        "message": "engine failed"}}
    assert closed


def test_a_client_that_leaves_closes_the_chat_stream() -> None:
    events, closed = read(FakeChatStream([ROLE, TEXT, TEXT, TEXT, "[DONE]"]), limit=3)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start"]
    assert closed
