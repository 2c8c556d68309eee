"""`hermes`: Hermes 2 Pro / Qwen style calls, each a JSON object between tags:

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first call; a last call may lack its closing tag.
"""

from __future__ import annotations

import json

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallForm,
    ParsedToolText,
    PartialToolCall,
    ToolParser,
    partial_call,
    partial_tag_length,
    skip_whitespace,
)
from vllm.sampling_params import SamplingParams

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class Hermes2ProToolParser(ToolParser):
    @classmethod
    def call_form(cls, name: str) -> CallForm:
        # As the hermes chat template renders a call (Jinja's tojson: ", " and ": ").
        return CallForm(TOOL_CALL_START,
                        f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ',
                        f"}}\n{TOOL_CALL_END}")

    def adjust_request(self, params: SamplingParams) -> None:
        # Where the tags are special tokens, skipping special tokens would erase them.
        special = getattr(self.tokenizer, "all_special_tokens", ())
        if TOOL_CALL_START in special:
            params.skip_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedToolText:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            if final:
                return ParsedToolText(text, [], True)
            held = partial_tag_length(text, TOOL_CALL_START)
            return ParsedToolText(text[:len(text) - held].rstrip(), [], True)
        calls: list[PartialToolCall] = []
        complete = True
        while start >= 0:
            body = skip_whitespace(text, start + len(TOOL_CALL_START))
            if body >= len(text) or text[body] != "{":
                complete = False
                break
            call, end = partial_call(text, body, self.arguments_keys)
            calls.append(call)
            if end is None:
                complete = False
                break
            close = text.find(TOOL_CALL_END, end)
            if close < 0:  # a last call without its closing tag still counts
                break
            start = text.find(TOOL_CALL_START, close + len(TOOL_CALL_END))
        return ParsedToolText(text[:text.find(TOOL_CALL_START)].rstrip(), calls, complete)
