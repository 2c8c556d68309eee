"""Structured outputs through `vllm serve` and the openai client (engine-core process, msgpack
wire types): response_format, vLLM's structured_outputs field and the guided_* spellings on
/v1/completions and /v1/chat/completions; finish_reason "length" for an unfinished
structure; bad constraints are 400s naming the problem while other requests are served.
The tiny model has random weights: whatever it prefers, the grammar holds."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"], "additionalProperties": False}
PHONE = r"\d{3}-\d{4}"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str):
    srv = RemoteServer(tiny_llama_dir, SMALL_ENGINE_ARGS)
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _valid(text: str) -> bool:
    value = json.loads(text)
    return value["color"] in ("red", "green") and 0 <= value["n"] <= 9 and len(value) == 2


def test_every_spelling_constrains(client, tiny_llama_dir):
    model = tiny_llama_dir
    messages = [{"role": "user", "content": "Pick a color."}]
    compact = {"disable_any_whitespace": True}
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "pick", "schema": SCHEMA, "strict": True}}).choices[0]
    content = chat.message.content or ""
    # Flexible whitespace (the default) lets a random model pad: done or cut off, it is JSON.
    assert _valid(content) if chat.finish_reason == "stop" else content.startswith("{")
    texts = {
        "structured_outputs json": client.completions.create(
            model=model, prompt="JSON:", max_tokens=40, temperature=0,
            extra_body={"structured_outputs": {"json": SCHEMA, **compact}}).choices[0],
        "guided_json": client.completions.create(
            model=model, prompt="JSON:", max_tokens=40, temperature=0.7, seed=1,
            extra_body={"guided_json": json.dumps(SCHEMA)}).choices[0],
    }
    for name, choice in texts.items():
        assert choice.finish_reason == "stop" and _valid(choice.text), (name, choice.text)
    regex = client.completions.create(model=model, prompt="Call", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": PHONE}).choices[0]
    assert re.fullmatch(PHONE, regex.text) and regex.finish_reason == "stop"
    for body in ({"guided_choice": ["yes", "no"]},
                 {"structured_outputs": {"choice": ["yes", "no"]}}):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=5,
                                             temperature=0, extra_body=body)
        assert out.choices[0].message.content in ("yes", "no")
    grammar = client.completions.create(
        model=model, prompt="G", max_tokens=10, temperature=0,
        extra_body={"guided_grammar": 'start: "a" ("b" | "c")'}).choices[0]
    assert grammar.text in ("ab", "ac")
    # Streaming: the joined deltas are one valid structure.
    stream = client.completions.create(
        model=model, prompt="JSON:", max_tokens=40, temperature=0, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA, **compact}})
    chunks = list(stream)
    assert _valid("".join(c.choices[0].text for c in chunks if c.choices))
    # An unfinished structure says "length".
    short = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                           temperature=0,
                                           response_format={"type": "json_object"})
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content.startswith("{")
    text = client.chat.completions.create(model=model, messages=messages, max_tokens=3,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, message", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
     "Invalid JSON schema"),
    ({"guided_regex": "(unclosed"}, "Invalid regex"),
    ({"guided_grammar": 'start: start "x"'}, "cannot match any output"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "Only one output constraint"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "takes one constraint"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "options but no constraint"),
    ({"structured_outputs": {"regexp": "a"}}, "regexp"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex, response_format"),
])
def test_bad_constraints_are_400s_while_others_are_served(server, client, tiny_llama_dir,
                                                          body, message):
    def good():
        return client.completions.create(model=tiny_llama_dir, prompt="Call", max_tokens=20,
                                         temperature=0, extra_body={"guided_regex": PHONE})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(good)
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": tiny_llama_dir, "prompt": "x", "max_tokens": 4, **body})
        assert re.fullmatch(PHONE, pending.result().choices[0].text)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
