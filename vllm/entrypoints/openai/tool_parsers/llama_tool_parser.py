"""`llama3_json`: Llama 3.1+ JSON calls. An output that starts (after an optional
`<|python_tag|>`) with `{` is one or more calls separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Any other output is all content. `arguments` is accepted in place of `parameters`.
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolText,
    PartialToolCall,
    ToolParser,
    partial_call,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    arguments_keys = ("parameters", "arguments")

    def parse(self, text: str, final: bool) -> ParsedToolText:
        i = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):  # "" or the tag's beginning
            return ParsedToolText("", [], True)
        if i >= len(text) or text[i] != "{":
            if i >= len(text) and not final:
                return ParsedToolText("", [], True)
            return ParsedToolText(text, [], True)
        calls: list[PartialToolCall] = []
        while True:
            call, end = partial_call(text, i, self.arguments_keys)
            calls.append(call)
            if end is None:
                return ParsedToolText("", calls, False)
            i = skip_whitespace(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_whitespace(text, i + 1)
            if i >= len(text):
                return ParsedToolText("", calls, True)
            if text[i] != "{":  # something other than a call follows
                return ParsedToolText("", calls, False)
