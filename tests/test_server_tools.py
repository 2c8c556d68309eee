"""Tool calling through the `openai` client against `vllm serve` (the default SmolLM2 model,
with a chat template that shows tools and the hermes parser for tool_choice "auto"): required,
named, auto (strict tools too), parallel, streamed and not, the Agents SDK on chat
completions; arguments validate against their schemas; forced calls cut by max_tokens; a
tool result fed back renders into the second turn. Strict response_format schemas on the
same model (a varied set, at temperature 0 and 0.8), and the field audit. One server for
the module."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import HERMES_TEMPLATE, TOOL_MODEL, RemoteServer
from tests.test_server_responses import (
    SHOWN_CALLS,
    check_tool_then_answer,
    run_agent,
    weather_agent,
)
from vllm.entrypoints.chat_utils import render_chat
from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tool_calls import AUTO_NEEDS_FLAGS, check_tool_request
from vllm.transformers_utils.tokenizer import get_tokenizer

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

TEMPLATE = HERMES_TEMPLATE
MODEL = TOOL_MODEL

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
SHOWN: list[Any] = [message for i, city in enumerate(["Rome", "Lima", "Cairo"]) for message in (
    {"role": "user", "content": f"What is the weather in {city}?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call-{i}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
)] + [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tool_server: RemoteServer) -> RemoteServer:
    return tool_server  # one server for the client-API modules (conftest)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kwargs) -> Any:
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0.0,
              "max_tokens": 100, **kwargs}
    return client.chat.completions.create(**kwargs)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kwargs
             ) -> tuple[str, list[tuple[str, str]], str | None]:
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
    if expect == "one":  # (streaming is the same code path as for "required")
        assert len(calls) == 1
        return
    if expect == "get_time":
        assert [name for name, _ in calls] == ["get_time"]
    assert streamed(client, **kwargs) == ("", calls, "tool_calls")


def test_required_with_n_samples_each_call(client: openai.OpenAI) -> None:
    """Sampled (n=3, one call each): every sample is a valid call, and they differ."""
    response = chat(client, tool_choice="required", parallel_tool_calls=False, n=3,
                    temperature=1.5, seed=5)
    samples = [calls_of(choice.message) for choice in response.choices]
    for calls in samples:
        assert len(calls) == 1
        assert_valid_calls(calls)
    assert len(set(map(tuple, samples))) > 1


@pytest.mark.parametrize("kwargs", [
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}])
def test_forced_calls_cut_by_max_tokens_say_length(client: openai.OpenAI, kwargs: dict
                                                   ) -> None:
    """Forced calls are compact JSON (no whitespace to spend the budget on); cut by
    max_tokens, the reply says "length" and holds no half call, as content or as a call;
    streamed, its fragments go out only as a call's arguments."""
    whole = chat(client, **kwargs).choices[0]
    [(_, arguments)] = calls_of(whole.message)[:1]
    assert whole.finish_reason == "tool_calls"
    assert arguments == json.dumps(json.loads(arguments), separators=(",", ":"),
                                   ensure_ascii=False)
    cut = chat(client, max_tokens=4, **kwargs)
    assert cut.usage.completion_tokens == 4
    message = cut.choices[0].message
    assert cut.choices[0].finish_reason == "length"
    assert message.content is None and not message.tool_calls
    content, calls, finish = streamed(client, max_tokens=4, **kwargs)
    assert content == "" and finish == "length"
    assert all(not json_complete(arguments) for _, arguments in calls)


def json_complete(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


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


STRICT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": True}}
                for t in TOOLS]


def test_auto_with_strict_tools_calls_validly_or_answers(client: openai.OpenAI) -> None:
    """Strict tools under "auto" (a grammar of text or hermes calls with strict arguments):
    shown how, the model calls; asked something else, it answers in text and ends."""
    response = chat(client, messages=SHOWN, tools=STRICT_TOOLS, tool_choice="auto")
    calls = calls_of(response.choices[0].message)
    assert [name for name, _ in calls] == ["get_weather"]
    assert_valid_calls(calls)
    assert response.choices[0].finish_reason == "tool_calls"
    hello = chat(client, messages=[{"role": "user", "content": "Say hello."}],
                 tools=STRICT_TOOLS, max_tokens=24).choices[0]
    assert hello.message.content and not hello.message.tool_calls
    assert hello.finish_reason == "stop"


def test_agents_sdk_calls_the_tool_then_answers_on_chat_completions(
        server: RemoteServer) -> None:
    """The Agents SDK on its chat-completions model (`OpenAIChatCompletionsModel`): see
    `check_tool_then_answer`."""
    check_tool_then_answer(f"{server.url}/v1", "OpenAIChatCompletionsModel")


def test_agents_sdk_default_setup_on_chat_completions_ends_in_an_answer(
        server: RemoteServer) -> None:
    """The SDK's defaults throughout on its chat-completions model: a strict tool, no
    tool_choice ("auto" on every turn). Shown how, the model calls the tool by itself with
    arguments its strict schema accepts; given the result, it answers in text."""
    from agents import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    agent, seen = weather_agent(f"{server.url}/v1", "OpenAIChatCompletionsModel")
    result = run_agent(agent, SHOWN_CALLS, max_turns=3)
    assert seen == ["Paris"]
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem,
                                                         MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output


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
    request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS})
    with pytest.raises(OpenAIError) as info:
        check_tool_request(request, tool_parser=None)
    assert info.value.message == AUTO_NEEDS_FLAGS
    assert "--enable-auto-tool-choice" in AUTO_NEEDS_FLAGS
    check_tool_request(ChatCompletionRequest.model_validate(
        {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}), tool_parser=None)


# ---- strict schemas: every schema of a varied set answers valid, complete JSON ------------

JSON_ASK = "Answer with a JSON value that matches the request."
# Schemas as a user writes them (issue 37): without additionalProperties; their objects must
# still have only the declared properties. (Strings and arrays bounded: a small model can
# repeat an unbounded list item until max_tokens, a different matter.)
TEXT = {"type": "string", "maxLength": 20}
OPEN_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": TEXT, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": TEXT, "temperature": {"type": "number"},
                                      "conditions": TEXT},
     "required": ["city", "temperature", "conditions"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"task": TEXT, "done": {"type": "boolean"}},
        "required": ["task", "done"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative"]},
                                      "score": {"type": "number"}},
     "required": ["label", "score"]},
    {"type": "object", "properties": {"title": TEXT, "author": {
        "type": "object", "properties": {"name": TEXT}, "required": ["name"]}},
     "required": ["title", "author"]},
]


def closed(schema: Any) -> Any:
    """The schema with additionalProperties false on every object (the validator's view of
    strict mode; the grammar's own closing is unit-tested in test_strict_schemas.py)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in ("items", "anyOf") else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def answer(client: openai.OpenAI, schema: dict[str, Any], temperature: float, seed: int,
           strict: bool) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": JSON_ASK}],
        temperature=temperature, seed=seed,
        max_tokens=150, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema, "strict": strict}}).choices[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_schema_answers_valid_complete_json(client: openai.OpenAI,
                                                  temperature: float) -> None:
    """tests/structured_output_schemas.py's 42 schemas (nested objects, bounded arrays,
    enums, patterns, formats, anyOf, refs) and schemas that do not say
    additionalProperties: every answer ends by itself and validates. Strict ones are
    compact; the others may use whitespace, bounded."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.structured_output_schemas import SCHEMAS as VARIED

    jobs = [(s, i, True) for i, s in enumerate(VARIED)] + \
        [(s, i, i % 2 == 0) for i, s in enumerate(OPEN_SCHEMAS)] + \
        [(s, i, False) for i, s in enumerate(VARIED[8:40:4])]
    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(lambda job: answer(client, job[0], temperature, job[1],
                                                   job[2]), jobs))
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for (schema, _, strict), choice in zip(jobs, choices, strict=True):
        content = choice.message.content or ""
        assert choice.finish_reason == "stop", (schema, content)
        errors = list(jsonschema.Draft202012Validator(
            closed(schema), format_checker=checker).iter_errors(json.loads(content)))
        assert not errors, (schema, content, errors[0].message)
        if strict:
            assert "\n" not in content and ": " not in content.split('"')[0], content


# ---- the field audit: every request field is honoured, refused by name, or advisory ---------

PROMPT = "The capital of France is"
REPEAT = "dog dog dog dog dog dog dog dog dog dog"
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)


class Fields:
    """Requests against the module's server, each with one field changed."""

    def __init__(self, server: RemoteServer, tokenizer: Any) -> None:
        self.url = server.url
        self.tokenizer = tokenizer

    def post(self, path: str, **body) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/{path}", json={"model": MODEL, **body}, timeout=120)

    def ok(self, path: str, **body) -> dict[str, Any]:
        response = self.post(path, **body)
        assert response.status_code == 200, response.text
        return response.json()

    def cmpl(self, **body) -> dict[str, Any]:
        return self.ok("completions", **{"prompt": PROMPT, "max_tokens": 8,
                                         "temperature": 0.0, **body})

    def chat(self, **body) -> dict[str, Any]:
        return self.ok("chat/completions", **{
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 64,
            "temperature": 0.0, **body})

    def refused(self, path: str, field: str, **body) -> None:
        base = {"prompt": PROMPT} if path == "completions" else {"messages": ASK}
        response = self.post(path, **{**base, "max_tokens": 4, **body})
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]

    def streamed_text(self, **body) -> tuple[str, list[dict]]:
        chunks = []
        with httpx.stream("POST", f"{self.url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
                "stream": True, **body}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def text(body: dict[str, Any], i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def gather(**calls: Callable[[], Any]) -> dict[str, Any]:
    """Each call on a thread of its own, so that the server batches them (the field audit
    is ~80 requests): name -> what its call returned (or raised)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
NARROW: tuple[dict[str, Any], ...] = ({"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0})
ADVISORY = {"user": "u-1", "safety_identifier": "s-1", "metadata": {"k": "v"}, "store": False}


def check_shared_sampling_fields(f: Fields) -> set[str]:
    """The fields completions and chat share (`SamplingRequest`), on /v1/completions."""
    first = gather(greedy=f.cmpl, repeat=lambda: f.cmpl(prompt=REPEAT, max_tokens=16),
                   said=f.chat)
    greedy, repeat, said = text(first["greedy"]), text(first["repeat"]), first["said"]
    stop = greedy.strip().split()[1]
    ids = f.tokenizer(greedy, add_special_tokens=False).input_ids
    spoken = said["usage"]["completion_tokens"]
    got = gather(
        missing=lambda: f.post("completions", prompt=PROMPT, model="nope"),
        **{p: functools.partial(f.cmpl, prompt=REPEAT, max_tokens=16, **{p: 2.0})
           for p in PENALTIES},
        **{f"narrow{i}": functools.partial(f.cmpl, temperature=1.5, seed=3, **narrow)
           for i, narrow in enumerate(NARROW)},
        sampled=lambda: f.cmpl(n=2, temperature=1.0),
        seeded=lambda: [text(f.cmpl(temperature=1.5, seed=s)) for s in (3, 3, 4)],
        stopped=lambda: f.cmpl(stop=[stop]),
        included=lambda: f.cmpl(stop=[stop], include_stop_str_in_output=True),
        streamed=lambda: f.streamed_text(stream_options={"include_usage": True}),
        advisory=lambda: f.cmpl(**ADVISORY),
        by_id=lambda: f.cmpl(stop_token_ids=[ids[1]]),
        past_eos=lambda: f.chat(ignore_eos=True, max_tokens=spoken + 3),
        special=lambda: f.chat(ignore_eos=True, max_tokens=spoken + 3,
                               skip_special_tokens=False),
        at_least=lambda: f.chat(min_tokens=spoken + 2),
        audited=lambda: f.cmpl(request_id="audit-1"),
        refusals=lambda: [
            f.refused("completions", "logit_bias", logit_bias={"1": 5.0}),
            f.refused("completions", "stream_options", stream_options={"include_usage": True}),
            f.refused("completions", "continuous_usage_stats", stream=True,
                      stream_options={"continuous_usage_stats": True}),
            f.refused("completions", "store", store=True),
            f.refused("completions", "metadata", metadata={str(i): "v" for i in range(17)})],
        # The same salt twice, then another: one after the other (the second must find
        # the first's blocks), on a prompt no other request sends.
        salted=lambda: [f.cmpl(prompt=LONG, cache_salt=s)["usage"]["prompt_tokens_details"]
                        ["cached_tokens"] for s in [uuid.uuid4().hex] * 2 + [uuid.uuid4().hex]],
    )
    assert got["missing"].status_code == 404
    for penalty in PENALTIES:
        assert text(got[penalty]) != repeat, penalty
    assert len(got["sampled"]["choices"]) == 2
    seeded = got["seeded"]
    assert seeded[0] == seeded[1] != seeded[2] and seeded[0] != greedy
    stopped = got["stopped"]["choices"][0]
    assert stopped["text"] == greedy[:greedy.index(stop)] and stopped["stop_reason"] == stop
    assert text(got["included"]) == greedy[:greedy.index(stop) + len(stop)]
    joined, chunks = got["streamed"]
    assert joined == greedy and chunks[-1]["usage"]["completion_tokens"] == 8
    for i, narrow in enumerate(NARROW):
        assert text(got[f"narrow{i}"]) == greedy, narrow
    assert text(got["advisory"]) == greedy
    by_id = got["by_id"]["choices"][0]
    assert by_id["stop_reason"] == ids[1] and by_id["text"] == f.tokenizer.decode(ids[:1])
    assert said["choices"][0]["finish_reason"] == "stop"
    assert got["past_eos"]["usage"]["completion_tokens"] == spoken + 3
    assert "<|im_" not in text(got["past_eos"]) and "<|im_" in text(got["special"])
    assert got["at_least"]["usage"]["completion_tokens"] >= spoken + 2
    salted = got["salted"]
    assert salted[0] == 0 and salted[1] > 0 and salted[2] == 0
    assert got["audited"]["id"] == "cmpl-audit-1"
    checked = {"model", *PENALTIES, "logit_bias", "n", "seed", "stop",
               "include_stop_str_in_output", "stream", "stream_options", "temperature",
               "top_p", "top_k", "min_p", *ADVISORY, "stop_token_ids", "ignore_eos",
               "min_tokens", "skip_special_tokens", "cache_salt", "request_id"}
    return checked | check_structured_output_fields(f)


def check_structured_output_fields(f: Fields) -> set[str]:
    """The structured-output fields (their own tests are in test_structured_output.py)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["a"],
              "additionalProperties": False}
    spellings = ({"response_format": {"type": "json_schema", "json_schema": {
                      "name": "a", "schema": schema}}},
                 {"structured_outputs": {"json": schema}}, {"guided_json": schema})
    got = gather(
        **{f"json{i}": functools.partial(f.cmpl, max_tokens=40, **body)
           for i, body in enumerate(spellings)},
        choice=lambda: f.cmpl(guided_choice=["yes", "no"]),
        regex=lambda: f.cmpl(guided_regex="[0-9]{3}"),
        grammar=lambda: f.cmpl(guided_grammar='root ::= "ab" | "cd"'))
    for i in range(len(spellings)):
        jsonschema.validate(json.loads(text(got[f"json{i}"])), schema)
    assert text(got["choice"]) in ("yes", "no")
    assert text(got["regex"]).isdigit()
    assert text(got["grammar"]) in ("ab", "cd")
    return {"response_format", "structured_outputs", "guided_json", "guided_choice",
            "guided_regex", "guided_grammar"}


def test_every_completions_and_chat_field_is_honoured_or_refused(
        server: RemoteServer, default_model_path: str) -> None:
    """Each field the request models define is sent and seen to act (or refused by name);
    the test fails when a field is added without a check here. Fields no request model
    defines (OpenAI's `audio`, `prediction`, `service_tier`, vLLM's `priority`, ...) are
    refused by name."""
    f = Fields(server, get_tokenizer(default_model_path))
    from vllm.entrypoints.openai.protocol import CompletionRequest, SamplingRequest

    shared = check_shared_sampling_fields(f)
    assert shared == set(SamplingRequest.model_fields)

    first = gather(greedy=f.cmpl, base=lambda: f.chat(max_tokens=8))
    greedy, base = first["greedy"], first["base"]
    messages = [{"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi"}]
    got = gather(
        echo=lambda: f.cmpl(echo=True),
        logprobs=lambda: f.cmpl(logprobs=2),
        five=lambda: f.cmpl(max_tokens=5, ignore_eos=True),
        best_of=lambda: f.cmpl(best_of=1),
        two_prompts=lambda: f.cmpl(prompt=[PROMPT, "Hi"]),
        **{f"special_{flag}": functools.partial(f.cmpl, add_special_tokens=flag, max_tokens=1)
           for flag in (True, False)},
        # Beam search: one beam is greedy; n of best_of beams come back best first
        # (the ranking's parity: test_beam_search.py).
        beam=lambda: f.cmpl(use_beam_search=True),
        beams=lambda: f.cmpl(use_beam_search=True, n=2, best_of=3, length_penalty=0.5,
                             logprobs=1),
        chat_logprobs=lambda: f.chat(max_tokens=8, logprobs=True, top_logprobs=2),
        chat_five=lambda: f.chat(max_tokens=5, ignore_eos=True),
        chat_six=lambda: f.chat(max_completion_tokens=6, max_tokens=9, ignore_eos=True),
        no_prompt=lambda: f.chat(max_tokens=1, add_generation_prompt=False),
        closed=lambda: f.chat(messages=messages, add_generation_prompt=False, max_tokens=1),
        continued=lambda: f.chat(messages=messages, add_generation_prompt=False, max_tokens=1,
                                 continue_final_message=True),
        chat_special=lambda: f.chat(max_tokens=1, add_special_tokens=True),
        unused_kwargs=lambda: f.chat(max_tokens=8, chat_template_kwargs={"unused": 1}),
        chat_beam=lambda: f.chat(max_tokens=8, use_beam_search=True),
        chat_beams=lambda: f.chat(max_tokens=8, use_beam_search=True, n=2, length_penalty=0.5))
    assert text(got["echo"]).startswith(PROMPT + text(greedy))
    assert len(got["logprobs"]["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2
    assert got["five"]["usage"]["completion_tokens"] == 5
    assert got["best_of"]["choices"] and got["two_prompts"]["choices"][1]
    for flag in (True, False):
        assert got[f"special_{flag}"]["usage"]["prompt_tokens"] == len(
            f.tokenizer(PROMPT, add_special_tokens=flag).input_ids)
    for field, value in (("best_of", 2), ("suffix", "x"), ("prompt_logprobs", 1),
                         ("prompt_embeds", "AAAA"), ("return_hidden_states", True),
                         ("length_penalty", 0.5)):
        f.refused("completions", field, **{field: value})
    assert text(got["beam"]) == text(greedy)
    beams = got["beams"]
    assert len(beams["choices"]) == 2 and text(beams) != beams["choices"][1]["text"]
    assert len(beams["choices"][1]["logprobs"]["tokens"]) == 8
    # Streaming and sampling fields are refused with beam search, by name.
    f.refused("completions", "use_beam_search", use_beam_search=True, stream=True)
    f.refused("completions", "top_p", use_beam_search=True, top_p=0.5)
    f.refused("completions", "best_of", use_beam_search=True, n=2, best_of=1)
    completion = {"prompt", "echo", "logprobs", "max_tokens", "best_of", "add_special_tokens",
                  "suffix", "prompt_logprobs", "prompt_embeds", "return_hidden_states",
                  "use_beam_search", "length_penalty"}
    assert shared | completion == set(CompletionRequest.model_fields)

    assert len(got["chat_logprobs"]["choices"][0]["logprobs"]["content"][0]
               ["top_logprobs"]) == 2
    f.refused("chat/completions", "top_logprobs", top_logprobs=2)
    assert got["chat_five"]["usage"]["completion_tokens"] == 5
    assert got["chat_six"]["usage"]["completion_tokens"] == 6
    assert base["usage"]["prompt_tokens"] > got["no_prompt"]["usage"]["prompt_tokens"]
    assert got["continued"]["usage"]["prompt_tokens"] < got["closed"]["usage"]["prompt_tokens"]
    assert got["chat_special"]["usage"]["prompt_tokens"] == len(
        f.tokenizer(f.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say hi."}], tokenize=False,
            chat_template=TEMPLATE.read_text(), add_generation_prompt=True)).input_ids)
    f.refused("chat/completions", "chat_template", chat_template="{{ 'x' }}")
    f.refused("chat/completions", "chat_template_kwargs", chat_template_kwargs={"tools": 1})
    assert text(got["unused_kwargs"]) == text(base)
    assert text(got["chat_beam"]) == text(base)
    beams = got["chat_beams"]
    assert len(beams["choices"]) == 2 and text(beams) != text(beams, 1)
    f.refused("chat/completions", "use_beam_search", use_beam_search=True, stream=True)
    f.refused("chat/completions", "length_penalty", length_penalty=0.5)
    chat_fields = {"messages", "logprobs", "top_logprobs", "max_tokens",
                   "max_completion_tokens", "add_generation_prompt", "continue_final_message",
                   "add_special_tokens", "chat_template", "chat_template_kwargs",
                   "tools", "tool_choice", "parallel_tool_calls",  # tools: tests above
                   "use_beam_search", "length_penalty"}
    assert shared | chat_fields == set(ChatCompletionRequest.model_fields)

    for field, value in (("audio", {"voice": "alloy"}),
                         ("prediction", {"type": "content", "content": "x"}),
                         ("service_tier", "auto"), ("priority", 1), ("functions", [])):
        f.refused("chat/completions", field, **{field: value})
