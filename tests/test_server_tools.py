"""Tool calling through the `openai` client against `vllm serve` (the default SmolLM2 model,
with a chat template that shows tools and the hermes parser for tool_choice "auto"): required,
named, auto, parallel, streamed and not; arguments validate against their schemas; a tool
result fed back renders into the second turn. One server for the module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.serving_chat import render_chat
from vllm.entrypoints.openai.serving_engine import OpenAIError
from vllm.entrypoints.openai.tool_calls import AUTO_NEEDS_FLAGS, check_tool_request
from vllm.transformers_utils.tokenizer import get_tokenizer

TEMPLATE = Path(__file__).parent.parent / "examples" / "tool_chat_template_hermes.jinja"
MODEL = "smollm2"

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"},
        "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["timezone", "hours"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
# A conversation that shows the model how it calls tools (for tool_choice "auto").
SHOWN = [message for i, city in enumerate(["Rome", "Lima", "Cairo"]) for message in (
    {"role": "user", "content": f"What is the weather in {city}?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call-{i}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
)] + [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(default_model_path: str):
    srv = RemoteServer(default_model_path, [
        "--served-model-name", MODEL, "--chat-template", str(TEMPLATE),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enforce-eager",
        *SMALL_ENGINE_ARGS, "--max-model-len", "1024", "--kv-cache-memory-bytes", "128MiB"])
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kwargs) -> Any:
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0.0,
              "max_tokens": 120, **kwargs}
    return client.chat.completions.create(**kwargs)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str, list[tuple[str, str]], str]:
    """(content, calls, finish_reason) joined from a stream, checking OpenAI's delta shape:
    a call's id, type and name once, in its first delta, then argument fragments."""
    content, names, arguments, finish = "", [], [], None
    for chunk in chat(client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.index == len(names):
                assert call.id and call.type == "function" and call.function.name
                names.append(call.function.name)
                arguments.append("")
            else:
                assert call.id is None and call.function.name is None
            arguments[call.index] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, list(zip(names, arguments, strict=True)), finish


def assert_valid_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("kwargs, expect", [
    ({"tool_choice": "required"}, "some"),
    ({"tool_choice": "required", "parallel_tool_calls": False}, "one"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "get_time"),
])
def test_forced_calls_validate_streamed_or_not(client: openai.OpenAI, kwargs: dict,
                                               expect: str) -> None:
    """"required" and a named function always give calls whose arguments validate against
    their function's schema; the stream joins into the same reply."""
    response = chat(client, **kwargs)
    message = response.choices[0].message
    calls = calls_of(message)
    assert_valid_calls(calls)
    assert response.choices[0].finish_reason == "tool_calls" and not message.content
    assert len({c.id for c in message.tool_calls}) == len(calls)
    if expect == "one":
        assert len(calls) == 1
    elif expect == "get_time":
        assert [name for name, _ in calls] == ["get_time"]
    assert streamed(client, **kwargs) == ("", calls, "tool_calls")


def test_required_with_n_samples_each_call(client: openai.OpenAI) -> None:
    response = chat(client, tool_choice="required", n=3, temperature=1.0, seed=5)
    assert len(response.choices) == 3
    for choice in response.choices:
        assert_valid_calls(calls_of(choice.message))


def test_auto_calls_a_tool_with_the_hermes_parser(client: openai.OpenAI) -> None:
    """Shown how it calls tools, the model calls one by itself: the hermes parser turns the
    tagged JSON into tool_calls (streamed or not, the same); under "none" the same text is
    left as content."""
    response = chat(client, messages=SHOWN, tool_choice="auto")
    message = response.choices[0].message
    calls = calls_of(message)
    assert [name for name, _ in calls] == ["get_weather"]
    assert_valid_calls(calls)
    assert json.loads(calls[0][1])["city"] == "Oslo"
    assert response.choices[0].finish_reason == "tool_calls"
    assert streamed(client, messages=SHOWN) == (message.content or "", calls, "tool_calls")
    plain = chat(client, messages=SHOWN, tool_choice="none").choices[0]
    assert not plain.message.tool_calls and plain.finish_reason == "stop"
    assert "<tool_call>" in (plain.message.content or "")


def test_tool_result_renders_into_the_second_turn(client: openai.OpenAI,
                                                  default_model_path: str) -> None:
    """The assistant's calls and the tool's result render through the template (the prompt
    the server counts is the one rendered here) and the model answers."""
    first = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = first.choices[0].message.tool_calls
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, cloudy"}]
    second = chat(client, messages=messages, tool_choice="none", max_tokens=24)
    tokenizer = get_tokenizer(default_model_path)
    prompt = render_chat(tokenizer, messages, True, chat_template=TEMPLATE.read_text(),
                         tools=TOOLS)
    assert "<tool_response>\n21 degrees, cloudy\n</tool_response>" in prompt
    assert json.dumps({"name": "get_weather", "arguments": json.loads(
        call.function.arguments)}) in prompt
    assert second.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)
                                             .input_ids)
    assert second.choices[0].message.content


@pytest.mark.parametrize("body, names", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "get_stock"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]},
     "strict"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_bad_tool_requests_are_400_naming_the_problem(server: RemoteServer, body: dict,
                                                      names: str) -> None:
    payload = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert names in response.json()["error"]["message"]


def test_auto_without_the_flags_is_refused_naming_them() -> None:
    request = ChatCompletionRequest(messages=ASK, tools=TOOLS)  # "auto" by default
    with pytest.raises(OpenAIError) as info:
        check_tool_request(request, tool_parser=None)
    assert info.value.message == AUTO_NEEDS_FLAGS
    assert "--enable-auto-tool-choice" in AUTO_NEEDS_FLAGS
    check_tool_request(ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="none"),
                       tool_parser=None)
