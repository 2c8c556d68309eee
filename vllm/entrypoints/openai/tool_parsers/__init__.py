"""Tool-call parsers by name (`--tool-call-parser NAME`): a new output format is one file
with a `ToolParser` subclass and one line in `_TOOL_PARSERS`."""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallForm,
    ExtractedToolCall,
    ExtractedToolCalls,
    ParsedToolText,
    PartialToolCall,
    ToolParser,
)
from vllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser

_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
}


class ToolParserManager:
    """Looks tool parsers up by the names `--tool-call-parser` takes."""

    @staticmethod
    def names() -> list[str]:
        return list(_TOOL_PARSERS)

    @staticmethod
    def get_tool_parser(name: str) -> type[ToolParser]:
        if name not in _TOOL_PARSERS:
            raise KeyError(f"Unknown tool call parser {name!r}; known: "
                           f"{', '.join(_TOOL_PARSERS)}.")
        return _TOOL_PARSERS[name]


__all__ = ["CallForm", "ExtractedToolCall", "ExtractedToolCalls", "ParsedToolText",
           "PartialToolCall", "ToolParser", "ToolParserManager"]
