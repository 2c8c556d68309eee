"""`llama3_json`: Llama 3.1+ JSON calls. An output that starts (after an optional
`<|python_tag|>`) with `{` is one or more calls separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Any other output is all content. `arguments` is accepted in place of `parameters`.

Strict tools under tool_choice "auto" constrain each call to `call_form`'s shape (as Llama
3.1's template renders one, Jinja's tojson: ", " and ": "). The grammar lets text come
before a call, but a call is only read at the start of the output, as here.
"""

from __future__ import annotations

import json

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallForm,
    ParsedToolText,
    PartialToolCall,
    ToolParser,
    partial_call,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    arguments_keys = ("parameters", "arguments")

    @classmethod
    def call_form(cls, name: str) -> CallForm:
        return CallForm('{"name": ', f'{{"name": {json.dumps(name)}, "parameters": ', "}")

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
