"""Client libraries that people point at a vLLM server, unchanged but for `base_url` (and the
served model's name), against `vllm serve` on the default model with the hermes tool
template and parser: LangChain's `ChatOpenAI` (invoke, stream, `bind_tools` with a named
tool and under "auto", `with_structured_output` by json_schema and by function_calling)
and instructor (JSON_SCHEMA and TOOLS modes) returning validated pydantic objects. Plain
replies are checked against the openai SDK's chat completion of the same messages (greedy:
the same text and prompt tokens). vLLM's `response_format` of type structural_tag on the
same server. One server for the module."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_utils import TOOL_MODEL, RemoteServer

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

MODEL = TOOL_MODEL
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": WEATHER_SCHEMA}}
HELLO = "Say hello in five words."


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population_millions: int = Field(ge=0, le=40)


CITY_PROMPT = "Describe Paris as JSON: its name, country and population in millions."


@pytest.fixture(scope="module")
def server(tool_server: RemoteServer) -> RemoteServer:
    return tool_server  # one server for the client-API modules (conftest)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def chat_model(server: RemoteServer, **kwargs: Any) -> Any:
    """LangChain's ChatOpenAI on this server: only base_url (and the model) set, greedy."""
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    kwargs = {"temperature": 0.0, "max_tokens": 24, **kwargs}
    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=SecretStr("x"),
                      max_retries=0, timeout=120, **kwargs)


# ---- LangChain -----------------------------------------------------------------------------


def test_langchain_invoke_and_stream_give_the_chat_completion(server: RemoteServer,
                                                              client: openai.OpenAI) -> None:
    expected = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": HELLO}], temperature=0.0,
        max_tokens=24)
    llm = chat_model(server)
    reply = llm.invoke(HELLO)
    assert reply.content == expected.choices[0].message.content and reply.content
    usage = expected.usage
    assert usage is not None
    assert reply.usage_metadata["input_tokens"] == usage.prompt_tokens
    assert reply.usage_metadata["output_tokens"] == usage.completion_tokens
    assert reply.response_metadata["finish_reason"] == expected.choices[0].finish_reason
    chunks = list(llm.stream(HELLO))
    assert len(chunks) > 2  # streamed, not one piece
    assert "".join(str(chunk.content) for chunk in chunks) == reply.content


def check_weather_call(message: Any, city: str) -> None:
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_SCHEMA)
    assert call["args"]["city"] == city


def test_langchain_bind_tools_with_a_named_tool(server: RemoteServer) -> None:
    llm = chat_model(server, max_tokens=48).bind_tools([WEATHER_TOOL],
                                                       tool_choice="get_weather")
    message = llm.invoke("What is the weather in Paris?")
    check_weather_call(message, "Paris")
    assert message.response_metadata["finish_reason"] == "tool_calls"


def shown_conversation() -> list[Any]:
    """Three questions answered by a call (the model learns how it calls), then a fourth."""
    from langchain_core.messages import AIMessage, HumanMessage

    messages: list[Any] = []
    for i, city in enumerate(["Rome", "Lima", "Cairo"]):
        messages += [HumanMessage(f"What is the weather in {city}?"), AIMessage("", tool_calls=[
            {"name": "get_weather", "args": {"city": city, "unit": "celsius"},
             "id": f"call-{i}"}])]
    return [*messages, HumanMessage("What is the weather in Oslo?")]


@pytest.mark.parametrize("strict", [None, True])
def test_langchain_bind_tools_under_auto_calls_or_answers(server: RemoteServer,
                                                          strict: bool | None) -> None:
    """tool_choice left to LangChain (none sent: "auto"), the tool plain and strict: shown
    how, the model calls the tool; asked something else, it answers in text."""
    llm = chat_model(server, max_tokens=48).bind_tools([WEATHER_TOOL], strict=strict)
    message = llm.invoke(shown_conversation())
    check_weather_call(message, "Oslo")
    hello = llm.invoke(HELLO)
    assert hello.content and not hello.tool_calls
    assert hello.response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_model(server: RemoteServer,
                                                            method: str) -> None:
    llm = chat_model(server, max_tokens=64).with_structured_output(City, method=method,
                                                                   include_raw=True)
    result = llm.invoke(CITY_PROMPT)
    assert result["parsing_error"] is None
    city = result["parsed"]
    assert isinstance(city, City) and city.name == "Paris"
    raw = result["raw"]
    if method == "function_calling":  # a forced call of the schema's function
        assert [call["name"] for call in raw.tool_calls] == ["City"]
    else:  # the reply's content is the object
        assert City.model_validate(json.loads(raw.content)) == city


# ---- instructor ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_a_validated_model(server: RemoteServer, mode: str) -> None:
    """One attempt (max_retries=0: no re-asking): the server's constraint makes the first
    answer valid."""
    import instructor

    patched = instructor.from_openai(
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120),
        mode=getattr(instructor.Mode, mode))
    city, completion = patched.chat.completions.create_with_completion(
        model=MODEL, response_model=City, max_retries=0, temperature=0.0, max_tokens=64,
        messages=[{"role": "user", "content": CITY_PROMPT}])
    assert isinstance(city, City) and city.name == "Paris"
    choice = completion.choices[0]
    if mode == "TOOLS":
        [call] = choice.message.tool_calls
        assert call.function.name == "City"
        assert json.loads(call.function.arguments) == city.model_dump()
    else:
        assert json.loads(choice.message.content) == city.model_dump()


# ---- response_format structural_tag (vLLM's) -----------------------------------------------


FUNCTION_TAG: dict[str, Any] = {"type": "structural_tag", "structures": [
    {"begin": "<function=get_weather>", "schema": WEATHER_SCHEMA, "end": "</function>"}],
    "triggers": ["<function="]}
# Three questions answered in the tag's form, then a fourth.
SHOWN_FUNCTIONS: list[Any] = [message for city in ["Rome", "Lima", "Cairo"] for message in (
    {"role": "user", "content": f"What is the weather in {city}?"},
    {"role": "assistant", "content": "<function=get_weather>" + json.dumps(
        {"city": city, "unit": "celsius"}) + "</function>"},
)] + [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_response_format_structural_tag(client: openai.OpenAI, server: RemoteServer) -> None:
    """Text in which each `<function=` starts a call with arguments valid against its
    (strict) schema; the same constraint as structured_outputs.structural_tag (greedy: the
    same text); a malformed one is a 400 naming its field."""
    def ask(**kwargs: Any) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=SHOWN_FUNCTIONS, temperature=0.0, max_tokens=48, **kwargs)
        assert response.choices[0].finish_reason == "stop"
        return response.choices[0].message.content or ""

    content = ask(response_format=FUNCTION_TAG)
    calls = re.findall(r"<function=get_weather>(.*?)</function>", content, re.S)
    assert calls and content.count("<function=") == len(calls)
    for arguments in calls:
        jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    assert json.loads(calls[0])["city"] == "Oslo"
    assert ask(extra_body={"structured_outputs": {"structural_tag": FUNCTION_TAG}}) == content
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": SHOWN_FUNCTIONS, "max_tokens": 4,
        "response_format": {**FUNCTION_TAG, "triggers": ["<tool_call>"]}})
    assert bad.status_code == 400, bad.text
    assert "response_format.structures[0].begin" in bad.json()["error"]["message"]
