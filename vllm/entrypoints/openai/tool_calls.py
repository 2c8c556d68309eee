"""Tool calling on `/v1/chat/completions`: which parser reads a request's output, the
constraint that enforces `tool_choice` "required" or a named function (a JSON schema, strict
and compact, so the output is at least one whole call unless max_tokens cuts it) or strict
tools under "auto" (a structural tag), and the streaming of calls as OpenAI deltas.

    tool_choice   prompt        output constrained to            read by
    "none"        tools shown   nothing                          nothing (all content)
    "auto"        tools shown   nothing; with a strict tool:     --tool-call-parser NAME
                                text, each call in the parser's
                                form with valid arguments
    "required"    tools shown   [{"name", "arguments"}, ...]     RequiredToolParser
    {function}    tools shown   that function's arguments        NamedToolParser
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.errors import OpenAIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)
from vllm.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls,
    ParsedToolText,
    PartialToolCall,
    ToolParser,
    ToolParserManager,
)
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    partial_call,
    skip_whitespace,
    value_end,
)
from vllm.sampling_params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set.')


def effective_tool_choice(request: ChatCompletionRequest) -> Any:
    """OpenAI's default: "auto" when tools are given, else "none"."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def check_tool_request(request: ChatCompletionRequest, tool_parser: str | None) -> None:
    """Raises OpenAIError naming what is wrong with the request's tool fields."""
    choice = effective_tool_choice(request)
    names = [t.function.name for t in request.tools or []]
    if choice != "none" and not names:
        raise OpenAIError(f"tool_choice {_describe(choice)} needs tools: the request has none.")
    if len(set(names)) != len(names):
        raise OpenAIError(f"tools has two functions of the same name: {names}.")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam) \
            and choice.function.name not in names:
        raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, which is "
                          f"not among the request's tools ({', '.join(names)}).")
    if choice == "auto":
        if tool_parser is None:
            raise OpenAIError(AUTO_NEEDS_FLAGS)
        strict = [t.function.name for t in request.tools or [] if t.function.strict]
        if strict and ToolParserManager.get_tool_parser(tool_parser).call_form(strict[0]) \
                is None:
            raise OpenAIError(f"tools {strict} set strict=true, which tool_choice \"auto\" "
                              f"cannot enforce with --tool-call-parser {tool_parser} (it "
                              "gives no form of a call amid text): use tool_choice "
                              "\"required\" or a named function.")


def _describe(choice: Any) -> str:
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return f"function {choice.function.name!r}"
    return repr(choice)


def _parameters(function: Any) -> dict[str, Any]:
    return function.parameters or {"type": "object", "properties": {}}


def tool_choice_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema the output must follow for "required" or a named function (None
    for "none" and "auto")."""
    choice = effective_tool_choice(request)
    tools = request.tools or []
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        [function] = [t.function for t in tools if t.function.name == choice.function.name]
        return _parameters(function)
    if choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "arguments": _parameters(t.function)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def tool_choice_constraint(request: ChatCompletionRequest, tool_parser: str | None
                           ) -> StructuredOutputsParams | None:
    """The output constraint of the request's tool choice: `tool_choice_schema`'s for
    "required" and a named function; for "auto" with a strict tool (checked by
    `check_tool_request`), free text in which each call, in the parser's `call_form`, has
    one of the functions' names and arguments valid against its schema. None: no
    constraint (the output is free)."""
    schema = tool_choice_schema(request)
    if schema is not None:
        return StructuredOutputsParams(json=schema)
    tools = request.tools or []
    if effective_tool_choice(request) != "auto" or tool_parser is None \
            or not any(t.function.strict for t in tools):
        return None
    parser = ToolParserManager.get_tool_parser(tool_parser)
    forms = [(parser.call_form(t.function.name), _parameters(t.function)) for t in tools]
    structures = [{"begin": form.begin, "schema": schema, "end": form.end}
                  for form, schema in forms if form is not None]
    triggers = list(dict.fromkeys(form.trigger for form, _ in forms if form is not None))
    return StructuredOutputsParams(structural_tag={"structures": structures,
                                                   "triggers": triggers})


class ForcedToolParser(ToolParser):
    """A forced choice's output is only calls (its grammar makes it so). What is not a whole
    call (an output cut by max_tokens: finish_reason "length") is dropped, never returned as
    content; a stream has sent its fragments as a call's arguments, never as content."""

    def extract(self, text: str) -> ExtractedToolCalls:
        extracted = super().extract(text)
        return extracted if extracted.calls else ExtractedToolCalls(None, [])


class NamedToolParser(ForcedToolParser):
    """The output is the named function's arguments object (enforced by its schema)."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedToolText:
        start = skip_whitespace(text, 0)
        if start >= len(text):
            return ParsedToolText("", [], False)
        end = value_end(text, start)
        arguments = text[start:len(text) if end is None else end]
        complete = end is not None and skip_whitespace(text, end) == len(text)
        return ParsedToolText("", [PartialToolCall(self.name, arguments, arguments)], complete)


class RequiredToolParser(ForcedToolParser):
    """The output is a JSON array of `{"name": ..., "arguments": {...}}` (enforced by
    `tool_choice_schema`)."""

    def __init__(self) -> None:
        super().__init__(None)

    def parse(self, text: str, final: bool) -> ParsedToolText:
        calls: list[PartialToolCall] = []
        i = skip_whitespace(text, 0)
        if i >= len(text) or text[i] != "[":
            return ParsedToolText("", calls, False)
        i = skip_whitespace(text, i + 1)
        while i < len(text) and text[i] == "{":
            call, end = partial_call(text, i, self.arguments_keys)
            calls.append(call)
            if end is None:
                break
            i = skip_whitespace(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_whitespace(text, i + 1)
            elif i < len(text) and text[i] == "]":
                return ParsedToolText("", calls, skip_whitespace(text, i + 1) == len(text))
        return ParsedToolText("", calls, False)


def make_tool_parser(request: ChatCompletionRequest, tokenizer: Any,
                     tool_parser: str | None) -> ToolParser | None:
    """The parser that reads this request's output (None: no tool calls to look for)."""
    choice = effective_tool_choice(request)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolParser(choice.function.name)
    if choice == "required":
        return RequiredToolParser()
    if choice == "auto" and tool_parser is not None:
        return ToolParserManager.get_tool_parser(tool_parser)(tokenizer)
    return None


def tool_calls_of(extracted: ExtractedToolCalls, max_calls: int | None) -> list[ToolCall]:
    return [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in extracted.calls[:max_calls]]


def finish_reason_with_tools(finish_reason: str | None, called: bool) -> str | None:
    """A reply that ended by itself with calls in it finishes with "tool_calls"."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class ToolCallStreamer:
    """Turns one choice's growing output into deltas: content, then for each call its id,
    type and name once and its argument fragments. What it sends joins into the
    non-streamed reply of the same text."""

    def __init__(self, parser: ToolParser, max_calls: int | None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = 0
        self.arguments_sent: list[int] = []  # per call sent so far: characters of arguments

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)

    def feed(self, delta_text: str, final: bool) -> DeltaMessage:
        self.text += delta_text
        if final:
            extracted = self.parser.extract(self.text)
            content = extracted.content or ""
            calls = [(c.name, c.arguments) for c in extracted.calls]
        else:
            parsed = self.parser.parse(self.text, final=False)
            content = parsed.content
            calls = []
            for call in parsed.calls:
                if call.name is None:
                    break
                calls.append((call.name, call.arguments))
        message = DeltaMessage(content=content[self.content_sent:] or None)
        self.content_sent = max(self.content_sent, len(content))
        for index, (name, arguments) in enumerate(calls[:self.max_calls]):
            delta = DeltaToolCall(index=index, function=DeltaFunctionCall())
            if index == len(self.arguments_sent):
                self.arguments_sent.append(0)
                delta.id, delta.type = random_tool_call_id(), "function"
                assert delta.function is not None
                delta.function.name = name
            fragment = arguments[self.arguments_sent[index]:]
            self.arguments_sent[index] = max(self.arguments_sent[index], len(arguments))
            if delta.id is None and not fragment:
                continue
            assert delta.function is not None
            delta.function.arguments = fragment
            message.tool_calls.append(delta)
        return message
