"""Strict tools under tool_choice "auto" with `--tool-call-parser llama3_json`, live: the
default model with a ChatML template that shows tools and renders calls in Llama 3.1's JSON
form (`{"name": ..., "parameters": {...}}`; no Llama model ships here). Shown how, the model
calls the strict tool with arguments its schema accepts (the grammar holds them), streamed
and not; asked something else, it answers in text. One server for the module."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer
from tests.test_server_tools import SHOWN, WEATHER

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

MODEL = "smollm2"
# ChatML (the default SmolLM2's) with the tools in the system turn and each call as
# llama3_json writes it.
TEMPLATE = """\
{%- if tools -%}
<|im_start|>system
To call a function, answer with {"name": <function-name>, "parameters": <arguments>}.
The functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
<|im_end|>
{% endif -%}
{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{% if message.get('tool_calls') -%}
{%- for call in message['tool_calls'] -%}
{%- if not loop.first %}; {% endif -%}
{{ {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}
{%- endfor %}
{%- else -%}
{{ message['content'] }}
{%- endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""
SCHEMA: dict[str, Any] = WEATHER["function"]["parameters"]
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


@pytest.fixture(scope="module")
def client(default_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("template") / "llama3_json.jinja"
    template.write_text(TEMPLATE)
    server = RemoteServer(default_model_path, [
        "--served-model-name", MODEL, "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
        *SMALL_ENGINE_ARGS, "--max-model-len", "1024", "--kv-cache-memory-bytes", "128MiB"])
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    assert server.stop() == 0, server.final_log


def test_strict_tool_under_auto_is_called_validly_or_answered(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "tools": [STRICT_WEATHER], "temperature": 0.0,
                              "max_tokens": 48}
    response = client.chat.completions.create(messages=SHOWN, **kwargs)
    choice = response.choices[0]
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and not choice.message.content
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMA)
    assert arguments["city"] == "Oslo" and choice.finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(messages=SHOWN, stream=True, **kwargs))
    streamed = "".join(c.function.arguments or "" for chunk in chunks if chunk.choices
                       for c in chunk.choices[0].delta.tool_calls or [] if c.function)
    assert streamed == call.function.arguments
    hello = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}], **{**kwargs, "max_tokens": 24})
    assert hello.choices[0].message.content and not hello.choices[0].message.tool_calls
    assert hello.choices[0].finish_reason == "stop"
