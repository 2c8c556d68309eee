"""Tool-call parsers on complete and streamed text: the calls found, the content kept, and
streamed deltas that join into exactly the non-streamed reply."""

from __future__ import annotations

import json
import random

import pytest

from vllm.entrypoints.openai.tool_calls import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
)
from vllm.entrypoints.openai.tool_parsers import (
    ExtractedToolCall,
    ExtractedToolCalls,
    ToolParser,
    ToolParserManager,
)
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    partial_tag_length,
    scan_object,
    value_end,
)


def hermes() -> ToolParser:
    return ToolParserManager.get_tool_parser("hermes")(None)


def llama3() -> ToolParser:
    return ToolParserManager.get_tool_parser("llama3_json")(None)


WEATHER = '{"city": "Paris", "unit": {"name": "celsius"}}'
CASES = [
    # (parser, model output, expected content, expected calls)
    (hermes, f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
     "</tool_call>", "Let me check.", [("get_weather", WEATHER)]),
    # arguments before the name, a name-like key inside the arguments, two calls, no end tag
    (hermes, '<tool_call>{"arguments": {"name": "x\\"}"}, "name": "a"}</tool_call>\n'
     '<tool_call> {"name": "b", "arguments": {}}', None,
     [("a", '{"name": "x\\"}"}'), ("b", "{}")]),
    (hermes, "No tools needed: 2 < 3 and <tool is not a tag.",
     "No tools needed: 2 < 3 and <tool is not a tag.", []),
    (llama3, f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
     '{"name": "now", "arguments": {}}', None, [("get_weather", WEATHER), ("now", "{}")]),
    (llama3, "  The weather is fine. {not a call}", "  The weather is fine. {not a call}", []),
    (lambda: RequiredToolParser(), f' [{{"name": "get_weather", "arguments": {WEATHER}}},'
     ' {"name": "now", "arguments": {}}] ', None, [("get_weather", WEATHER), ("now", "{}")]),
    (lambda: NamedToolParser("get_weather"), f"\n{WEATHER} ", None,
     [("get_weather", WEATHER)]),
]


@pytest.mark.parametrize("make, text, content, calls", CASES)
def test_complete_and_streamed_text_give_the_same_calls(make, text, content, calls) -> None:
    """extract() finds the calls (arguments exactly as written) and the content; feeding
    the same text in random pieces sends deltas that join into that reply: each call's id,
    type and name once, in its first delta, then argument fragments."""
    expected = ExtractedToolCalls(text if not calls else content,
                                  [ExtractedToolCall(n, a) for n, a in calls])
    assert make().extract(text) == expected
    for seed in range(4):
        rng = random.Random(seed)
        streamer = ToolCallStreamer(make(), max_calls=None)
        streamed_content, names, arguments, ids = "", [], [], []
        i = 0
        while i < len(text):
            step = 1 if seed == 0 else rng.randint(1, 7)
            piece, i = text[i:i + step], i + step
            delta = streamer.feed(piece, final=i >= len(text))
            streamed_content += delta.content or ""
            for call in delta.tool_calls:
                assert call.function is not None
                if call.index == len(names):
                    assert call.id and call.type == "function" and call.function.name
                    names.append(call.function.name)
                    ids.append(call.id)
                    arguments.append("")
                else:
                    assert call.id is None and call.function.name is None
                arguments[call.index] += call.function.arguments or ""
        assert streamed_content == (expected.content or "")
        assert list(zip(names, arguments, strict=True)) == calls
        assert len(set(ids)) == len(ids)
        assert streamer.called == bool(calls)


def test_a_stream_holds_back_what_may_start_a_call() -> None:
    streamer = ToolCallStreamer(hermes(), max_calls=None)
    assert streamer.feed("Sure \n<tool", final=False).content == "Sure"
    assert streamer.feed("box", final=False).content == " \n<toolbox"
    llama = ToolCallStreamer(llama3(), max_calls=None)
    assert llama.feed(" <|pyth", final=False).content is None
    assert llama.feed("on_tag|>{", final=False).content is None
    function = llama.feed('"name": "f"', final=False).tool_calls[0].function
    assert function is not None and function.name == "f"


@pytest.mark.parametrize("make, text", [
    (hermes, '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),  # unclosed JSON
    (hermes, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # not an object
    (hermes, '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),  # name not a string
    (hermes, '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>'),  # bad literal
    (llama3, '{"name": "f", "parameters": {}} and then prose'),
])
def test_a_malformed_call_leaves_the_output_as_content(make, text) -> None:
    assert make().extract(text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("make, text", [
    (lambda: RequiredToolParser(), '[{"name": "f", "arguments": {}}'),  # cut short (length)
    (lambda: NamedToolParser("f"), '{"a": 1} {"b": 2}'),
])
def test_a_forced_choice_never_returns_a_half_call_as_content(make, text) -> None:
    """Forced choices' output is only calls: what is not a whole call is dropped."""
    assert make().extract(text) == ExtractedToolCalls(None, [])


def test_max_calls_keeps_the_first_call_only() -> None:
    streamer = ToolCallStreamer(RequiredToolParser(), max_calls=1)
    delta = streamer.feed('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
                          final=True)
    assert [c.function.name for c in delta.tool_calls if c.function] == ["a"]


def test_json_scanning() -> None:
    assert value_end('{"a": [1, "]"]} tail', 0) == 15
    assert value_end('{"a": "\\"}', 0) is None  # the string is still open
    assert value_end("12", 0) is None and value_end("12,", 0) == 2  # a number may grow
    scan = scan_object('{"x": {"name": 1}, "name": "n", "y": [', 0)
    assert scan.end is None and list(scan.members) == ["x", "name", "y"]
    assert scan.members["name"] == (27, 30)
    assert json.loads('{"x": {"name": 1}, "name": "n"}'[27:30]) == "n"
    assert partial_tag_length("ok <tool", "<tool_call>") == 5
    assert partial_tag_length("ok <tool_call", "</tool_call>") == 0


def test_unknown_parser_name_lists_the_known_ones() -> None:
    assert ToolParserManager.names() == ["hermes", "llama3_json"]
    with pytest.raises(KeyError, match="hermes, llama3_json"):
        ToolParserManager.get_tool_parser("mistral")
