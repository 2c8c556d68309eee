"""`/v1/messages` through the `anthropic` SDK, unchanged (only base_url and api_key set),
against `vllm serve` on the default model (the hermes tool template and parser): plain and
streamed replies (the event order on the wire), a tool round trip, stop sequences,
max_tokens, count_tokens, and Anthropic-shaped errors. Each reply is checked against
`/v1/chat/completions` answering the same conversation: one request model below both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer
from vllm.entrypoints.chat_utils import render_chat
from vllm.transformers_utils.tokenizer import get_tokenizer

# End to end (a server): left out of `make test-fast`.
pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).parent.parent / "examples" / "tool_chat_template_hermes.jinja"
MODEL = "smollm2"
KEY = "test-key"
ASK: Any = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You answer in one short sentence."
WEATHER: Any = {
    "name": "get_weather", "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}
TIME: Any = {
    "name": "get_time", "description": "The current time in a time zone.",
    "input_schema": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 24}},
        "required": ["timezone"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
WEATHER_ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_model_path: str):
    srv = RemoteServer(default_model_path, [
        "--served-model-name", MODEL, "--chat-template", str(TEMPLATE),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-key", KEY,
        *SMALL_ENGINE_ARGS, "--max-model-len", "1024", "--kv-cache-memory-bytes", "128MiB"])
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


# The current SDK has no sampling parameters (they go in the body: extra_body).
GREEDY = {"temperature": 0.0}


def create(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    """A Messages request (greedy unless said), sampling fields sent in the body."""
    sampling = {name: kwargs.pop(name) for name in ("temperature", "top_p", "top_k")
                if name in kwargs}
    extra_body = {**GREEDY, **sampling, **kwargs.pop("extra_body", {})}
    kwargs = {"model": MODEL, "max_tokens": 24, "messages": ASK, **kwargs}
    return client.messages.create(**kwargs, extra_body=extra_body)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_reply_is_the_chat_reply(client: anthropic.Anthropic,
                                       chat_client: openai.OpenAI) -> None:
    """A system prompt and a question: the Message holds the text chat completions gives
    for the same conversation, and the same token counts (input split into computed and
    prefix-cached tokens)."""
    message = create(client, system=SYSTEM, metadata={"user_id": "u-1"})
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    chat = chat_client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0.0,
        messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert text_of(message) == chat.choices[0].message.content and text_of(message)
    assert [b.type for b in message.content] == ["text"]
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None
    usage = message.usage
    assert chat.usage is not None
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == \
        chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    # Blocks and strings say the same; sampling narrowed to the top token is greedy.
    blocks = create(client, system=[{"type": "text", "text": SYSTEM}], messages=[
        {"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}],
        temperature=1.0, top_k=1)
    assert text_of(blocks) == text_of(message)
    assert text_of(create(client, system=SYSTEM, temperature=1.0, top_p=1e-6)) == \
        text_of(message)


def test_streamed_events_in_order_and_joined_by_the_sdk(client: anthropic.Anthropic,
                                                        server: RemoteServer) -> None:
    """On the wire: message_start, ping, one text block (start, deltas, stop),
    message_delta with the stop reason and usage, message_stop, each named by its type;
    the SDK's stream helper joins them into the non-streamed Message."""
    plain = create(client, max_tokens=16)
    with client.messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                messages=ASK) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == text_of(plain) == text_of(final) and len(texts) > 1
    assert (final.stop_reason, final.usage.output_tokens) == (plain.stop_reason,
                                                               plain.usage.output_tokens)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)

    events = []
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=120, headers={
            "x-api-key": KEY, "anthropic-version": "2023-06-01"}, json={
            "model": MODEL, "max_tokens": 16, "temperature": 0.0, "messages": ASK,
            "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * deltas, "content_block_stop",
                     "message_delta", "message_stop"] and deltas > 1
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    assert "".join(e["delta"]["text"] for e in events[3:3 + deltas]) == text_of(plain)
    assert events[-2]["delta"]["stop_reason"] == plain.stop_reason
    assert events[-2]["usage"]["output_tokens"] == plain.usage.output_tokens


def test_tool_round_trip(client: anthropic.Anthropic, default_model_path: str) -> None:
    """A named tool is always called (input valid against its schema, streamed or not);
    its result goes back as a tool_result block and renders through the template
    (count_tokens counts that prompt), and the model answers in text."""
    first = create(client, max_tokens=64, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMAS["get_weather"])
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY,
                                messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed: Any = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", call.input)]
    assert streamed.stop_reason == "tool_use"

    conversation = [*WEATHER_ASK, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": call.id,
                                                  "content": "21 degrees, cloudy"}]}]
    second = create(client, max_tokens=24, messages=conversation, tools=[WEATHER, TIME],
                    tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and text_of(second)
    counted = client.messages.count_tokens(model=MODEL, messages=conversation,
                                           tools=[WEATHER, TIME])
    assert counted.input_tokens == second.usage.input_tokens + (
        second.usage.cache_read_input_tokens or 0)
    tokenizer = get_tokenizer(default_model_path)
    prompt = render_chat(tokenizer, [*WEATHER_ASK, {
        "role": "assistant", "content": "", "tool_calls": [{
            "id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, cloudy"}], True,
        chat_template=TEMPLATE.read_text(),
        tools=[{"type": "function", "function": {
            "name": t["name"], "description": t["description"],
            "parameters": t["input_schema"]}} for t in (WEATHER, TIME)])
    assert "<tool_response>\n21 degrees, cloudy\n</tool_response>" in prompt
    assert counted.input_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)


def test_any_tool_calls_one_and_only_one_when_asked(client: anthropic.Anthropic) -> None:
    message = create(client, max_tokens=96, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use"
    jsonschema.validate(call.input, SCHEMAS[call.name])


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    """The reply stops before the sequence (streamed or not), naming it."""
    full = text_of(create(client))
    word = full.split()[2]
    stopped = create(client, stop_sequences=["zzz-never", word])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert text_of(stopped) == full[:full.index(word)]
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK,
                                stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == (
        "stop_sequence", word, text_of(stopped))


def test_max_tokens_and_prefill(client: anthropic.Anthropic,
                                chat_client: openai.OpenAI) -> None:
    cut = create(client, max_tokens=3, messages=[
        {"role": "user", "content": "Write a long story about a dragon."}])
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    prefill: Any = [*ASK, {"role": "assistant", "content": "The capital of France"}]
    continued = create(client, messages=prefill)
    chat = chat_client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0.0, messages=prefill,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert text_of(continued) == chat.choices[0].message.content and text_of(continued)


def test_count_tokens_is_the_prompt_generation_reads(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    message = create(client, system=SYSTEM, max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0)
    longer = client.messages.count_tokens(model=MODEL, system=SYSTEM + " Be polite.",
                                          messages=ASK)
    assert longer.input_tokens > counted.input_tokens


CONTINUOUS: Any = {"include_usage": True, "continuous_usage_stats": True}


def test_chat_streams_usage_on_every_chunk_when_asked(chat_client: openai.OpenAI) -> None:
    """What the Messages stream reads its message_start usage from: chat's
    continuous_usage_stats (the first chunk, before any token, has the prompt's count)."""
    chunks = list(chat_client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0, messages=ASK, stream=True,
        stream_options=CONTINUOUS))
    assert all(c.usage is not None for c in chunks)
    first, last = chunks[0].usage, chunks[-1].usage
    assert first is not None and last is not None
    assert first.prompt_tokens == last.prompt_tokens > 0 and first.completion_tokens == 0
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and last.completion_tokens == counts[-1] > 0


def anthropic_error(info: pytest.ExceptionInfo) -> dict[str, Any]:
    body = info.value.body
    assert body["type"] == "error", body
    return body["error"]


@pytest.mark.parametrize("kwargs, status, names", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"extra_body": {"logit_bias": {"1": 5}}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400, "'image'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_stock"}}, 400,
     "get_stock"),
    ({"temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 5000}, 400, "maximum context length"),
    ({"model": "claude-nope"}, 404, "claude-nope"),
])
def test_errors_take_anthropics_form(client: anthropic.Anthropic, kwargs: dict,
                                     status: int, names: str) -> None:
    with pytest.raises(anthropic.APIStatusError) as info:
        create(client, **kwargs)
    assert info.value.status_code == status
    error = anthropic_error(info)
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert names in error["message"]


def test_required_fields_and_keys(server: RemoteServer) -> None:
    """max_tokens is required, as Anthropic requires it; the API key goes in x-api-key or
    as a bearer token (the SDK's api_key and auth_token); a wrong one is Anthropic's 401."""
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                          json={"model": MODEL, "messages": ASK}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == {"type": "invalid_request_error",
                                        "message": "max_tokens: Field required"}
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.count_tokens(model=MODEL, messages=ASK)
    assert anthropic_error(info)["type"] == "authentication_error"
    # The OpenAI endpoints keep OpenAI's error body.
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-api-key": KEY},
                          json={"model": MODEL, "messages": ASK, "thinking": {}}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
