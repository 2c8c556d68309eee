"""The tool-parser interface, and the tolerant JSON scanning the parsers share.

A parser reads the text a model wrote and finds the tool calls in it. It answers for a text
that is still growing (streaming) as well as for a finished one, and everything it reports
for a growing text is a prefix of what it reports once the text is finished: the content
so far, each call's name once its string is closed, and each call's arguments as the raw
JSON text written so far. So the argument fragments a stream sends join into exactly the
arguments of the non-streamed reply.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from vllm.sampling_params import SamplingParams

_WHITESPACE = " \t\n\r"
_SCALAR = re.compile(r"[-+0-9.eEa-zA-Z]+")


class PartialToolCall(NamedTuple):
    name: str | None  # None until the name's string is closed
    arguments: str  # raw JSON text of the arguments object so far ("" before it starts)
    object_text: str  # the call's whole JSON object so far


class ParsedToolText(NamedTuple):
    content: str  # text that is surely content (a growing text holds back what may start a call)
    calls: list[PartialToolCall]
    complete: bool  # every call's JSON is closed and nothing malformed follows


class CallForm(NamedTuple):
    """How a format writes one call of a function in free text: `begin`, the arguments
    object, `end`; `trigger` (a prefix of `begin` shared by every function's call) is what
    starts a call. E.g. hermes: "<tool_call>", '<tool_call>\\n{"name": "f", "arguments": ',
    "}\\n</tool_call>"."""

    trigger: str
    begin: str
    end: str


class ExtractedToolCall(NamedTuple):
    name: str
    arguments: str  # the arguments object as the model wrote it (valid JSON)


class ExtractedToolCalls(NamedTuple):
    content: str | None
    calls: list[ExtractedToolCall]  # empty: the text is all content


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End of the JSON string opening at text[i] (a quote); None if the text ends first."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End of the JSON value starting at text[i]; None if the text ends before it does.

    Only strings and brackets are tracked, so malformed JSON is found later, by `json.loads`.
    E.g. value_end('{"a": [1, "]"]} tail', 0) == 15.
    """
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            if text[j] == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if text[j] in "{[":
                depth += 1
            elif text[j] in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    match = _SCALAR.match(text, i)
    end = match.end() if match else i + 1
    return end if end < len(text) else None  # a number at the end may still grow


class ObjectScan(NamedTuple):
    end: int | None  # end of the object; None: not closed yet (or malformed)
    members: dict[str, tuple[int, int | None]]  # key -> (value start, value end or None)


def scan_object(text: str, i: int) -> ObjectScan:
    """The top-level members of the JSON object opening at text[i] (a `{`), as far as the
    text goes: keys nested in values are never mistaken for the object's own."""
    members: dict[str, tuple[int, int | None]] = {}
    j = skip_whitespace(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan(j + 1, members)
    while j < len(text) and text[j] == '"':
        key_end = string_end(text, j)
        if key_end is None:
            break
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            break
        j = skip_whitespace(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        j = skip_whitespace(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        members[key] = (j, end)
        if end is None:
            break
        j = skip_whitespace(text, end)
        if j < len(text) and text[j] == "}":
            return ObjectScan(j + 1, members)
        if j >= len(text) or text[j] != ",":
            break
        j = skip_whitespace(text, j + 1)
    return ObjectScan(None, members)


def partial_call(text: str, i: int, arguments_keys: tuple[str, ...]
                 ) -> tuple[PartialToolCall, int | None]:
    """The call written as a JSON object at text[i] (`{"name": ..., "arguments": {...}}`)
    so far, and the object's end (None: not closed)."""
    scan = scan_object(text, i)
    name = None
    if "name" in scan.members:
        start, end = scan.members["name"]
        if end is not None and text[start] == '"':
            try:
                name = json.loads(text[start:end])
            except ValueError:  # a bad escape: the call fails validation later
                name = None
    arguments = ""
    for key in arguments_keys:
        if key in scan.members:
            start, end = scan.members[key]
            if text[start] == "{":
                arguments = text[start:len(text) if end is None else end]
            break
    object_text = text[i:len(text) if scan.end is None else scan.end]
    return PartialToolCall(name, arguments, object_text), scan.end


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (it may be the tag's
    beginning, so a stream holds it back). partial_tag_length("ok <tool", "<tool_call>") == 5"""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolParser(ABC):
    """Finds tool calls in a model's output (one subclass per output format)."""

    # The keys a call's arguments object may have, in order of preference.
    arguments_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def call_form(cls, name: str) -> CallForm | None:
        """How the format writes a call of function `name` amid text (None: it has no such
        form; strict tools under tool_choice "auto" need one, see `tool_calls.py`)."""
        return None

    def adjust_request(self, params: SamplingParams) -> None:
        """Changes the sampling of a request this parser will read (e.g. keep the special
        tokens that mark a call). By default, nothing."""
        return

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedToolText:
        """What `text` holds so far. Not `final`: the text may still grow, so content that
        could be the start of a call (or whitespace before one) is held back. `final`:
        content before a call has its trailing whitespace stripped."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The tool calls of a finished output; a malformed call makes it all content."""
        parsed = self.parse(text, final=True)
        if not parsed.calls or not parsed.complete:
            return ExtractedToolCalls(text, [])
        calls = []
        for call in parsed.calls:
            try:
                obj = json.loads(call.object_text)
                arguments = json.loads(call.arguments) if call.arguments else None
            except ValueError:
                return ExtractedToolCalls(text, [])
            if not isinstance(obj, dict) or not isinstance(call.name, str) \
                    or not isinstance(arguments, dict):
                return ExtractedToolCalls(text, [])
            calls.append(ExtractedToolCall(call.name, call.arguments))
        return ExtractedToolCalls(parsed.content or None, calls)
