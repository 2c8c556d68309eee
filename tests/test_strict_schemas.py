"""Strict schemas and bounded whitespace without a model: how `strict_schema` closes objects
(and leaves data and explicit choices alone), what the compiled grammars allow on a tiny
tokenizer, how the server's fields merge into one constraint (strict response_format and
tool calls compact, vLLM's options-only `structured_outputs`), and forced tool choices
that never return a half call as content."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.tool_calls import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    check_tool_request,
    tool_choice_constraint,
    tool_choice_schema,
)
from vllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from vllm.sampling_params import SamplingParams
from vllm.sampling_params import StructuredOutputsParams as S
from vllm.v1.structured_output.backend import BOUNDED_WHITESPACE, grammar_key, strict_schema
from vllm.v1.structured_output.manager import GrammarCompiler

INT = {"type": "integer", "minimum": 0, "maximum": 9}


def test_objects_without_additional_properties_are_closed() -> None:
    schema = {"type": "object", "properties": {
        "x": {"type": "object", "properties": {"n": INT}},
        "open": {"type": "object", "additionalProperties": True},
        "typed": {"type": "object", "additionalProperties": INT},
        "list": {"type": "array", "items": {"properties": {"k": INT}}},
        "nullable": {"type": ["object", "null"], "properties": {"k": INT}},
        "tuple": {"type": "array", "prefixItems": [INT]},
        "rest": {"type": "array", "prefixItems": [INT], "items": INT}},
        "$defs": {"D": {"type": "object"}}}
    closed = strict_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["x"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == INT
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["nullable"]["additionalProperties"] is False
    assert props["tuple"]["items"] is False and props["rest"]["items"] == INT
    assert closed["$defs"]["D"]["additionalProperties"] is False
    bounded = strict_schema({"type": "integer", "exclusiveMinimum": 0})
    assert bounded == {"type": "integer", "exclusiveMinimum": 0, "maximum": 2**53 - 1}
    huge = {"type": "integer", "minimum": 2**60}  # beyond the default bound: left open
    assert strict_schema(huge) == huge
    assert list(props) == list(schema["properties"])  # order kept: it is the output's
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_data_and_property_names_are_not_schemas() -> None:
    """const, enum, default and examples hold data; a property may be named "properties"."""
    obj = {"type": "object", "properties": {"a": INT}}
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"type": {"const": "object"}}},
        "c": {"const": obj}, "e": {"enum": [obj]}, "d": {"default": obj, "examples": [obj]}}}
    props = strict_schema(schema)["properties"]
    assert props["properties"]["properties"] == {"type": {"const": "object"}}
    assert props["properties"]["additionalProperties"] is False
    assert props["c"] == {"const": obj} and props["e"] == {"enum": [obj]}
    assert props["d"] == {"default": obj, "examples": [obj]}


def test_composed_objects_close_as_a_whole() -> None:
    part_a = {"type": "object", "properties": {"a": INT}, "required": ["a"]}
    part_b = {"properties": {"b": {"type": "object", "properties": {"n": INT}}}}
    closed = strict_schema({"$defs": {"A": part_a}, "allOf": [{"$ref": "#/$defs/A"}, part_b]})
    # The parts stay open at their top (closing each would forbid the other's properties);
    # the node declares the union and closes; what is nested inside a part closes.
    assert closed["properties"] == {"a": {}, "b": {}}
    assert closed["additionalProperties"] is False
    inlined, b = closed["allOf"]
    assert "additionalProperties" not in inlined and inlined["properties"] == {"a": INT}
    assert "additionalProperties" not in b
    assert b["properties"]["b"]["additionalProperties"] is False
    # Alternatives of a non-object node are whole objects: each closes.
    alternatives = strict_schema({"anyOf": [part_a, {"type": "null"}]})
    assert alternatives["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in alternatives
    # anyOf on an object node adds to it: the node declares the parts' properties.
    mixed = strict_schema({"type": "object", "properties": {"k": INT},
                           "anyOf": [{"properties": {"x": INT}}, {"properties": {"y": INT}}]})
    assert list(mixed["properties"]) == ["k", "x", "y"]
    assert "additionalProperties" not in mixed["anyOf"][0]


def test_json_object_stays_open_and_keys_carry_whitespace() -> None:
    schema = {"type": "object", "properties": {"a": INT}}
    assert json.loads(grammar_key(S(json_object=True)).spec) == {"type": "object"}
    assert json.loads(grammar_key(S(json=schema)).spec)["additionalProperties"] is False
    assert grammar_key(S(json=schema)).whitespace == BOUNDED_WHITESPACE
    assert grammar_key(S(json=schema, disable_any_whitespace=False)).whitespace == \
        BOUNDED_WHITESPACE
    assert grammar_key(S(json=schema, disable_any_whitespace=True)).whitespace == ""
    assert grammar_key(S(json=schema, whitespace_pattern=" ?")).whitespace == " ?"
    with pytest.raises(ValueError, match="whitespace_pattern cannot be combined"):
        S(json=schema, whitespace_pattern=" ?", disable_any_whitespace=True)


# ---- the compiled grammars, on the tiny model's tokenizer ----------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, len(tokenizer))


def accepts(compiler: GrammarCompiler, tokenizer: Any, params: S, text: str) -> bool:
    """Whether the grammar takes `text`, fed one single-character token at a time (so no
    tokenization of the text decides it)."""
    by_char = {}
    for token_id in range(len(tokenizer)):
        by_char.setdefault(tokenizer.convert_tokens_to_string(
            tokenizer.convert_ids_to_tokens([token_id])), token_id)
    grammar = compiler.new_matcher(params)
    return all(grammar.accept_tokens([by_char[char]]) for char in text)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_strict_grammars_refuse_undeclared_properties(compiler, tokenizer) -> None:
    ok = '{"name":"Al","age":3}'
    assert accepts(compiler, tokenizer, S(json=PERSON), ok)
    assert not accepts(compiler, tokenizer, S(json=PERSON), '{"name":"Al","age":3,"x":1}')
    assert not accepts(compiler, tokenizer, S(json=PERSON), '{"x":1')
    open_schema = {**PERSON, "additionalProperties": True}
    assert accepts(compiler, tokenizer, S(json=open_schema), '{"name":"Al","age":3,"x":1}')
    typed = {**PERSON, "additionalProperties": {"type": "boolean"}}
    assert accepts(compiler, tokenizer, S(json=typed), '{"name":"Al","age":3,"x":true}')
    assert not accepts(compiler, tokenizer, S(json=typed), '{"name":"Al","age":3,"x":1}')
    assert accepts(compiler, tokenizer, S(json_object=True), '{"anything":[1]}')
    # Integers end: at most I-JSON's 16 digits.
    assert accepts(compiler, tokenizer, S(json={"type": "integer"}), str(-(2**53 - 1)))
    assert not accepts(compiler, tokenizer, S(json={"type": "integer"}), "1" * 17)


def test_whitespace_is_bounded_or_compact(compiler, tokenizer) -> None:
    pretty = '{\n  "name": "Al",\n  "age": 3\n}'
    assert accepts(compiler, tokenizer, S(json=PERSON), pretty)
    assert not accepts(compiler, tokenizer, S(json=PERSON), "{\n\n")  # one line break
    assert not accepts(compiler, tokenizer, S(json=PERSON), "{" + " " * 25)  # a bounded indent
    assert accepts(compiler, tokenizer, S(json=PERSON), "{" + " " * 24 + '"')
    compact = S(json=PERSON, disable_any_whitespace=True)
    assert accepts(compiler, tokenizer, compact, '{"name":"A b","age":3}')  # inside strings
    assert not accepts(compiler, tokenizer, compact, "{ ")
    assert accepts(compiler, tokenizer, S(json=PERSON, whitespace_pattern="[ ]{0,40}"),
                   "{" + " " * 40 + '"')


# ---- one constraint from the request's fields ----------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


def constraint(request_type: type, **body: Any) -> S | None:
    extra = {"messages": MESSAGES} if request_type is ChatCompletionRequest else {}
    return request_type.model_validate({**extra, **body}).structured_outputs_params()


def json_schema_format(strict: bool | None) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                   "strict": strict}}


def test_strict_response_format_is_compact_unless_asked_otherwise() -> None:
    strict = constraint(ChatCompletionRequest, response_format=json_schema_format(True))
    assert strict is not None and strict.json == PERSON and strict.disable_any_whitespace
    loose = constraint(ChatCompletionRequest, response_format=json_schema_format(None))
    assert loose is not None and grammar_key(loose).whitespace == BOUNDED_WHITESPACE
    # vLLM's spelling of the options beside response_format: structured_outputs, options only.
    pretty = constraint(ChatCompletionRequest, response_format=json_schema_format(True),
                        structured_outputs={"disable_any_whitespace": False})
    assert pretty is not None and pretty.disable_any_whitespace is False
    compact = constraint(CompletionRequest, prompt="x", guided_json=PERSON,
                         structured_outputs={"disable_any_whitespace": True})
    assert compact is not None and compact.json == PERSON and compact.disable_any_whitespace
    with pytest.raises(ValueError, match="options but no constraint"):
        constraint(CompletionRequest, prompt="x",
                   structured_outputs={"disable_any_whitespace": True})
    with pytest.raises(ValueError, match="options but no constraint"):
        SamplingParams(structured_outputs=S(disable_any_whitespace=True))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER],
                                                 **body})


def forced(request: ChatCompletionRequest) -> tuple[str, S]:
    schema = tool_choice_schema(request)
    assert schema is not None
    return "tool_choice", S(json=schema)


def test_tool_choice_constraints_are_strict_compact_and_alone() -> None:
    request = chat_request(tool_choice="required")
    params = request.structured_outputs_params(forced(request))
    assert params is not None and params.disable_any_whitespace
    calls = json.loads(grammar_key(params).spec)
    assert calls["minItems"] == 1
    assert calls["items"]["properties"]["arguments"]["additionalProperties"] is False
    request = chat_request(tool_choice="required",
                           structured_outputs={"disable_any_whitespace": False})
    params = request.structured_outputs_params(forced(request))
    assert params is not None and params.disable_any_whitespace is False
    request = chat_request(tool_choice="required", response_format=json_schema_format(True))
    with pytest.raises(ValueError, match="got response_format, tool_choice"):
        request.structured_outputs_params(forced(request))


def test_forced_calls_cut_by_max_tokens_are_never_content() -> None:
    named = NamedToolParser("get_weather")
    assert named.extract('{"city": "Par').content is None
    assert named.extract('{"city": "Par').calls == []
    assert [c.name for c in named.extract('{"city":"Paris"}').calls] == ["get_weather"]
    required = RequiredToolParser()
    cut = '[{"name":"get_weather","arguments":{"city":"Pa'
    assert required.extract(cut) == (None, [])
    assert required.extract("[\n\n\n") == (None, [])
    # Streamed: the fragments go out as the call's arguments; the end sends no content.
    streamer = ToolCallStreamer(named, None)
    deltas = [streamer.feed('{"city": ', False), streamer.feed('"Pa', True)]
    assert all(d.content is None for d in deltas)
    assert "".join(c.function.arguments or "" for d in deltas for c in d.tool_calls
                   if c.function is not None) == '{"city": '


# ---- strict tools under tool_choice "auto": a structural tag --------------------------------


def ends(compiler: GrammarCompiler, tokenizer: Any, params: S, text: str) -> bool:
    """Whether the grammar takes `text` (one character a token) and may end after it."""
    by_char = {}
    for token_id in range(len(tokenizer)):
        by_char.setdefault(tokenizer.convert_tokens_to_string(
            tokenizer.convert_ids_to_tokens([token_id])), token_id)
    grammar = compiler.new_matcher(params)
    return all(grammar.accept_tokens([by_char[char]]) for char in text) \
        and grammar.accept_tokens([tokenizer.eos_token_id])


CALL_TAG = {"type": "structural_tag", "triggers": ["<f>"], "structures": [
    {"begin": "<f>a:", "schema": PERSON, "end": "</f>"}]}


@pytest.mark.parametrize("tag, message", [
    ("{not json", "structural_tag is not valid JSON"),
    ([], "structural_tag must be a JSON object"),
    ({**CALL_TAG, "format": {}}, r"got \['format'\]"),
    ({**CALL_TAG, "type": "x"}, 'type must be "structural_tag"'),
    ({**CALL_TAG, "triggers": [""]}, "triggers must be a non-empty list of non-empty strings"),
    ({**CALL_TAG, "structures": []}, "structures must be a non-empty list"),
    ({**CALL_TAG, "structures": [{"begin": "<f>", "schema": {}}]},
     r"structures\[0\] must be \{begin: string, schema: JSON schema, end: string\}"),
    ({**CALL_TAG, "structures": [{"begin": "<g>", "schema": {}, "end": ""}]},
     r"structures\[0\].begin '<g>' does not start with any of the triggers"),
    ({**CALL_TAG, "triggers": ["<f>", "<h>"]}, r"triggers\[1\] '<h>' begins none"),
])
def test_structural_tags_are_checked_by_name(tag: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        S(structural_tag=tag if isinstance(tag, str) else json.dumps(tag))


def test_structural_tag_grammar_is_text_with_strict_structures(compiler, tokenizer) -> None:
    tag = S(structural_tag=CALL_TAG, disable_any_whitespace=True)
    assert json.loads(grammar_key(tag).spec)["structures"][0]["schema"][
        "additionalProperties"] is False
    assert ends(compiler, tokenizer, tag, "any text <g> at all")
    assert ends(compiler, tokenizer, tag, 'x <f>a:{"name":"Al","age":3}</f> y')
    assert ends(compiler, tokenizer, tag,
                '<f>a:{"name":"A","age":1}</f><f>a:{"name":"B","age":2}</f>')
    assert not ends(compiler, tokenizer, tag, "text <f>")  # a trigger starts a structure
    assert not accepts(compiler, tokenizer, tag, "text <f>b")
    assert not accepts(compiler, tokenizer, tag, '<f>a:{"name":"Al","age":3,"x":1}')  # strict
    assert not accepts(compiler, tokenizer, tag, '<f>a:{"name": "Al"')  # compact
    assert not ends(compiler, tokenizer, tag, '<f>a:{"name":"Al"}</f>')  # age is required
    bounded = S(structural_tag=json.dumps(CALL_TAG))
    assert ends(compiler, tokenizer, bounded, '<f>a:{"name": "Al",\n "age": 3}</f>')
    assert not accepts(compiler, tokenizer, bounded, '<f>a:{"name": "Al",\n\n')


def test_response_format_structural_tag_is_the_same_constraint() -> None:
    """vLLM's `response_format: {"type": "structural_tag", ...}` gives the constraint that
    `structured_outputs.structural_tag` gives (bounded whitespace: it is not strict)."""
    by_format = chat_request(tools=None, response_format=CALL_TAG).structured_outputs_params()
    by_params = chat_request(tools=None, structured_outputs={"structural_tag": CALL_TAG}
                             ).structured_outputs_params()
    assert by_format is not None and by_params is not None
    assert grammar_key(by_format) == grammar_key(by_params)
    assert grammar_key(by_format).whitespace == BOUNDED_WHITESPACE


@pytest.mark.parametrize("response_format, message", [
    ({**CALL_TAG, "structures": None}, "response_format.structures must be a non-empty list"),
    ({**CALL_TAG, "triggers": ["<g>"]},
     r"response_format.structures\[0\].begin '<f>a:' does not start with any of the triggers"),
    ({**CALL_TAG, "structures": [{"begin": "<f>", "end": "</f>"}]},
     r"response_format.structures\[0\] must be \{begin: string, schema: JSON schema"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}},
     r"got \['format'\] \(the newer `format` form is not supported\)"),
    ({"type": "json_object", "triggers": ["<f>"]},
     "response_format of type 'json_object' takes no triggers"),
    ({**CALL_TAG, "json_schema": {"name": "x", "schema": {}}},
     "response_format of type 'structural_tag' takes no json_schema"),
])
def test_malformed_response_format_structural_tags_are_refused_by_name(
        response_format: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chat_request(tools=None, response_format=response_format).structured_outputs_params()


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_strict_tools_under_auto_get_the_parsers_call_form(compiler, tokenizer) -> None:
    """tool_choice "auto" with a strict tool: free text, or hermes calls of the request's
    functions with valid (strict, compact) arguments, which the hermes parser reads."""
    request = chat_request(tools=[STRICT_WEATHER, TIME_TOOL])
    check_tool_request(request, "hermes")
    constraint = tool_choice_constraint(request, "hermes")
    assert constraint is not None
    params = request.structured_outputs_params(("tool_choice", constraint))
    assert params is not None and params.disable_any_whitespace
    assert tool_choice_constraint(chat_request(), "hermes") is None  # not strict: free
    assert tool_choice_constraint(chat_request(tools=[STRICT_WEATHER], tool_choice="none"),
                                  "hermes") is None
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
    assert ends(compiler, tokenizer, params, "It is sunny.")
    assert ends(compiler, tokenizer, params, "Let me see." + call + "\n")
    assert ends(compiler, tokenizer, params, call + call.replace(
        '"get_weather", "arguments": {"city":"Oslo"}', '"get_time", "arguments": {}'))
    for bad in ('"get_stock", ', '"get_weather", "arguments": {"town"',
                '"get_weather", "arguments": {"city":"Oslo","unit":"c"}',
                '"get_weather", "arguments": {"city": '):
        assert not accepts(compiler, tokenizer, params, '<tool_call>\n{"name": ' + bad)
    assert not ends(compiler, tokenizer, params, call[:40])
    extracted = Hermes2ProToolParser(None).extract("Let me see." + call + "\n")
    assert extracted.content == "Let me see."
    assert extracted.calls == [("get_weather", '{"city":"Oslo"}')]


def test_strict_tools_under_auto_get_the_llama3_json_call_form(compiler, tokenizer) -> None:
    """llama3_json: the same grammar of text and calls, each call in Llama 3.1's JSON form
    (`{"name": ..., "parameters": {...}}`, several separated by "; "), which the parser
    reads from the start of the output."""
    request = chat_request(tools=[STRICT_WEATHER, TIME_TOOL])
    check_tool_request(request, "llama3_json")
    constraint = tool_choice_constraint(request, "llama3_json")
    assert constraint is not None
    params = request.structured_outputs_params(("tool_choice", constraint))
    assert params is not None and params.disable_any_whitespace
    weather = '{"name": "get_weather", "parameters": {"city":"Oslo"}}'
    time = '{"name": "get_time", "parameters": {}}'
    assert ends(compiler, tokenizer, params, "It is sunny.")
    assert ends(compiler, tokenizer, params, weather)
    assert ends(compiler, tokenizer, params, f"{weather}; {time}")
    for bad in ('"get_stock", ', '"get_weather", "arguments": ',
                '"get_weather", "parameters": {"town"',
                '"get_weather", "parameters": {"city":"Oslo","unit":"c"}',
                '"get_weather", "parameters": {"city": '):
        assert not accepts(compiler, tokenizer, params, '{"name": ' + bad)
    assert not ends(compiler, tokenizer, params, weather[:30])
    parser = Llama3JsonToolParser(None)
    assert parser.extract(f"{weather}; {time}").calls == [
        ("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")]
    streamer = ToolCallStreamer(parser, None)
    deltas = [streamer.feed(weather[i:i + 7], final=False) for i in range(0, len(weather), 7)]
    deltas.append(streamer.feed("", final=True))
    assert "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls
                   if call.function is not None) == '{"city":"Oslo"}'
    assert not any(d.content for d in deltas)


def test_a_parser_without_a_call_form_refuses_strict_tools_under_auto(monkeypatch) -> None:
    monkeypatch.setattr(Llama3JsonToolParser, "call_form", classmethod(lambda cls, name: None))
    with pytest.raises(OpenAIError, match="cannot enforce with --tool-call-parser llama3_json"):
        check_tool_request(chat_request(tools=[STRICT_WEATHER]), "llama3_json")


def test_a_trigger_that_is_a_special_token_is_that_token(tiny_llama_dir: str) -> None:
    """Where <tool_call> is a special token (Qwen's tokenizers), a call starts with that
    token: the tokenizer's, not its text spelled in other tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    special = tokenizer.convert_tokens_to_ids("<tool_call>")
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer))
    request = chat_request(tools=[STRICT_WEATHER])
    constraint = tool_choice_constraint(request, "hermes")
    assert constraint is not None
    params = request.structured_outputs_params(("tool_choice", constraint))
    assert params is not None

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    call = [*ids("Sure."), special,
            *ids('\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>')]
    assert call.count(special) == 1
    grammar = compiler.new_matcher(params)
    assert grammar.accept_tokens(call) and grammar.accept_tokens([tokenizer.eos_token_id])
    grammar = compiler.new_matcher(params)
    assert not grammar.accept_tokens([*ids("Sure."), special, *ids("Oslo")])
