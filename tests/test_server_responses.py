"""`/v1/responses` through the `openai` client and the OpenAI Agents SDK against `vllm serve`
(the default model, the hermes tool template and parser): plain and streamed (the event
sequence), a function-tool round trip through `function_call_output`, `text.format`
json_schema, `previous_response_id`, retrieval (during a stream too) and deletion,
prompt_embeds parts, the Agents SDK in its default setup (strict tools, "auto"), and the 400s
and 404s. Each Response is checked against the chat completion it translates to: the
same prompt tokens and, greedy, the same text. One server for the module."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import (
    TOOL_MODEL,
    RemoteServer,
    encode_tensor,
    scrape_metrics,
    wait_until,
)
from tests.test_server_chat_embeds import embed, tokenizer  # noqa: F401 (fixtures)

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

MODEL = TOOL_MODEL
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather",
                           "description": "The current weather in a city.",
                           "parameters": WEATHER_SCHEMA, "strict": True}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tool_server: RemoteServer) -> RemoteServer:
    return tool_server  # one server for the client-API modules (conftest)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def respond(client: openai.OpenAI, **kwargs) -> Any:
    kwargs = {"model": MODEL, "input": ASK, "temperature": 0.0, "max_output_tokens": 24,
              **kwargs}
    return client.responses.create(**kwargs)


def chat(client: openai.OpenAI, messages: list[dict], **kwargs) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          temperature=0.0, max_tokens=24, **kwargs)


def test_plain_response_is_the_chat_completion(client: openai.OpenAI) -> None:
    response = respond(client, instructions="Answer briefly.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    same = chat(client, [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": ASK}])
    assert response.output_text == same.choices[0].message.content
    assert response.usage.input_tokens == same.usage.prompt_tokens
    assert response.usage.output_tokens == same.usage.completion_tokens
    assert response.usage.total_tokens == same.usage.total_tokens
    cut = respond(client, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def _events(client: openai.OpenAI, **kwargs) -> list[Any]:
    return list(respond(client, stream=True, **kwargs))


def test_streamed_events_come_in_order_and_join_into_the_response(
        client: openai.OpenAI) -> None:
    events = _events(client)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", events[-1].type]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    plain = respond(client)
    assert "".join(deltas) == events[-4].text == final.output_text == plain.output_text
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    """A named tool_choice gives a function_call whose arguments validate; its output fed back
    as function_call_output renders (as the chat request of the same turns does) and the
    model answers in text. The same call streamed: argument deltas join into .done."""
    first = respond(client, tools=[WEATHER],
                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert first.status == "completed"
    turns = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}]
    second = respond(client, input=turns, tools=[WEATHER], tool_choice="none")
    assert second.output[0].type == "message" and second.output_text
    same = chat(client, [{"role": "user", "content": ASK},
                         {"role": "assistant", "tool_calls": [{
                             "id": call.call_id, "type": "function", "function": {
                                 "name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id,
                          "content": "21 C, sunny"}],
                tools=[{"type": "function", "function": {
                    k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == same.choices[0].message.content

    events = _events(client, tools=[WEATHER], tool_choice="required", max_output_tokens=100)
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and \
        types[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for event in done:
        joined = "".join(e.delta for e in events if e.type ==
                         "response.function_call_arguments.delta" and e.item_id == event.item_id)
        assert joined == event.arguments
        jsonschema.validate(json.loads(event.arguments), WEATHER_SCHEMA)
    calls = [item for item in events[-1].response.output if item.type == "function_call"]
    assert [c.arguments for c in calls] == [e.arguments for e in done] and calls


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60}},
        "required": ["city", "temperature"], "additionalProperties": False}
    response = respond(client, max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    anything = respond(client, max_output_tokens=200, text={"format": {"type": "json_object"}},
                       input="Give Paris's country as JSON, in one short line.")
    assert anything.status == "completed", anything.output_text
    assert isinstance(json.loads(anything.output_text), dict)


def test_previous_response_id_continues_the_stored_conversation(
        client: openai.OpenAI) -> None:
    first = respond(client, input="My name is Ada.", instructions="Be kind.")
    second = respond(client, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    same = chat(client, [{"role": "user", "content": "My name is Ada."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}])
    # The instructions are not carried over (OpenAI's rule).
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == same.choices[0].message.content
    third = respond(client, input="And again?", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_retrieve_delete_and_unknown_ids(client: openai.OpenAI, server: RemoteServer) -> None:
    response = respond(client, metadata={"k": "v"})
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    assert again.metadata == {"k": "v"} and again.usage == response.usage
    unstored = respond(client, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(missing)
        assert missing in str(info.value)
    with pytest.raises(openai.NotFoundError) as info:
        respond(client, previous_response_id="resp_nope")
    assert "resp_nope" in str(info.value)
    deleted = httpx.delete(f"{server.url}/v1/responses/{response.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    streamed = _events(client)[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


@pytest.mark.parametrize("body, named", [
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input_image"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "schema"),
])
def test_what_is_not_implemented_is_refused_by_name(server: RemoteServer, body: dict,
                                                    named: str) -> None:
    response = httpx.post(f"{server.url}/v1/responses", timeout=60,
                          json={"model": MODEL, "input": ASK, "max_output_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_prompt_embeds_parts_give_the_reply_of_the_same_text(client: openai.OpenAI,
                                                             embed) -> None:  # noqa: F811
    part = {"type": "prompt_embeds", "data": encode_tensor(embed(ASK))}
    by_rows = respond(client, input=[{"role": "user", "content": [part]}])
    by_text = respond(client, input=[{"role": "user", "content": [
        {"type": "input_text", "text": ASK}]}])
    assert by_rows.output_text == by_text.output_text
    assert by_rows.usage.input_tokens == by_text.usage.input_tokens


def weather_agent(url: str, model_class: str = "OpenAIResponsesModel", **settings: Any
                  ) -> tuple[Any, list[str]]:
    """An Agents SDK agent on one of its models (its Responses model by default), unchanged
    but for the client's base_url, with the SDK's default function tool (strict), and the
    cities the tool was called with. The model is the default SmolLM2, greedy."""
    import agents
    from agents import Agent, ModelSettings, function_tool

    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"21 degrees in {city}"

    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    model = getattr(agents, model_class)(model=MODEL, openai_client=client)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                  tools=[get_weather], model_settings=ModelSettings(
                      temperature=0.0, **{"max_tokens": 96, **settings}))
    return agent, seen


def run_agent(agent: Any, given: Any, **kwargs: Any) -> Any:
    from agents import RunConfig, Runner

    return Runner.run_sync(agent, given, run_config=RunConfig(tracing_disabled=True), **kwargs)


def check_tool_then_answer(url: str, model_class: str) -> None:
    """The SDK's default setup: a strict tool, and tool_choice back to "auto" once the tool
    was used (so the second turn is "auto" with a strict tool: a 400 before). Required on
    the first turn (the model does not call by itself on a bare question): the SDK runs the
    tool, feeds its result back (function_call and function_call_output items, or chat's
    tool message) and the model answers in text."""
    from agents import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    agent, seen = weather_agent(url, model_class, tool_choice="required")
    result = run_agent(agent, ASK, max_turns=3)
    assert seen == ["Paris"]
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem,
                                                         MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output


# Shown how it calls the tool (calls with no results yet), the model calls it by itself.
SHOWN_CALLS = [item for i, city in enumerate(["Rome", "Lima", "Cairo"]) for item in (
    {"role": "user", "content": f"What is the weather in {city}?"},
    {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
     "arguments": json.dumps({"city": city})})] + [{"role": "user", "content": ASK}]


def test_agents_sdk_calls_its_strict_tool_under_the_default_tool_choice(
        server: RemoteServer) -> None:
    """The SDK's defaults throughout (strict tool, no tool_choice: "auto"): the model calls
    the tool with arguments its strict schema accepts, and the tool's result ends the run."""
    agent, seen = weather_agent(f"{server.url}/v1")
    agent.tool_use_behavior = "stop_on_first_tool"
    result = run_agent(agent, SHOWN_CALLS)
    assert seen == ["Paris"] and result.final_output == "21 degrees in Paris"


def test_agents_sdk_calls_the_tool_then_answers(server: RemoteServer) -> None:
    check_tool_then_answer(f"{server.url}/v1", "OpenAIResponsesModel")


def test_a_streamed_response_is_retrievable_while_in_flight(client: openai.OpenAI) -> None:
    """GET during the stream: the response as it stands ("in_progress", the text so far);
    after it, the stored one."""
    events = iter(respond(client, stream=True, max_output_tokens=64))
    created = next(events)
    first = next(e for e in events if e.type == "response.output_text.delta")
    now = client.responses.retrieve(created.response.id)
    rest = list(events)
    assert now.status == "in_progress" and now.output_text.startswith(first.delta)
    done = client.responses.retrieve(created.response.id)
    assert done.status == rest[-1].response.status != "in_progress"
    assert done.output_text == rest[-1].response.output_text
    assert done.output_text.startswith(now.output_text)


def requests_aborted(server: RemoteServer) -> float:
    return sum(value for name, value in scrape_metrics(server).items()
               if name.startswith("vllm:request_success_total{")
               and 'finished_reason="abort"' in name)


def test_deleting_a_streamed_response_in_flight_stops_it(client: openai.OpenAI,
                                                         server: RemoteServer) -> None:
    """DELETE during the stream: the generation stops (its engine request aborted, long
    before its 400 tokens), the stream ends with the response "cancelled", and the id is
    gone."""
    before = requests_aborted(server)
    events = iter(respond(client, input="Count from one to three hundred in words.",
                          stream=True, max_output_tokens=400))
    created = next(events)
    next(e for e in events if e.type == "response.output_text.delta")
    deleted = httpx.delete(f"{server.url}/v1/responses/{created.response.id}", timeout=30)
    assert deleted.json() == {"id": created.response.id, "object": "response.deleted",
                              "deleted": True}
    last = list(events)[-1]
    assert last.type == "response.failed" and last.response.status == "cancelled"
    assert last.response.output_text and last.response.output[-1].status == "incomplete"
    wait_until(lambda: requests_aborted(server) == before + 1, "the request was aborted")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.response.id)
